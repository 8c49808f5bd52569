"""``push``: folder checks, the dry-run list, and real uploads to a local fake Hub that records every request."""

import hashlib
import os
import re
import shutil
import socket

import pytest
from huggingface_hub import _upload_pipeline, constants
from huggingface_hub.utils import _detect_agent

from conftest import tiny_sessa_model
from fake_hub import FakeHub
from hf_mixers.apps.cli import main as cli_main
from hf_mixers.model_cards.push import PushError, check_folder, format_files, push_folder

TOKEN = "hf_fake_write_token"
CARD = ("---\nlibrary_name: transformers\nlicense: apache-2.0\npipeline_tag: text-generation\ntags:\n- hf-mixers\n---\n\n"
        "# Tiny Sessa\n\nA test.\n")
# Never shipped (IGNORE_PATTERNS): hidden files and folders, compiled Python, training checkpoints.
JUNK = (".git/HEAD", ".cache/huggingface/upload/model.safetensors.metadata", ".DS_Store", "eval/.ipynb_checkpoints/x",
        "__pycache__/modeling_hf_mixers.cpython-311.pyc", "eval/__pycache__/util.pyc", "stray.pyc",
        "checkpoint-10/model.safetensors", "runs/checkpoint-5/optimizer.pt", ".tiny.partial-x1/model.safetensors")
SHIPPED_EXTRA = {"eval/report.json": b'{"perplexity": 12.5}\n', "checkpoint_notes.md": b"not a checkpoint folder\n"}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "tiny"
    tiny_sessa_model().save_pretrained(folder)
    (folder / "README.md").write_text(CARD)
    return folder


@pytest.fixture
def folder(tmp_path, saved_model):
    """A copy of the saved model, plus junk that must not be shipped and extra files that must."""
    target = tmp_path / "tiny"
    shutil.copytree(saved_model, target)
    for name in JUNK:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(b"junk\0")
    for name, data in SHIPPED_EXTRA.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(data)
    return target


@pytest.fixture
def no_token(monkeypatch, tmp_path):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-such-token"))  # no `hf auth login` file


@pytest.fixture
def online(monkeypatch, no_token):
    """Undo the suite's HF_HUB_OFFLINE=1 for this test: huggingface_hub read it at import into its constants."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    # Building the user agent fetches an "agent harnesses" registry from constants.ENDPOINT (huggingface.co, not the
    # endpoint given to HfApi) once per process when online: start from the empty registry it falls back to.
    monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)


@pytest.fixture
def without_xet(monkeypatch):
    # hf_xet (a dependency of huggingface_hub 2.4.0 on x86_64/arm64) uploads every "lfs" file through Xet storage,
    # whatever the server answers; a fake Xet CAS is out of reach, so the LFS test uses the documented switch
    # HF_HUB_DISABLE_XET, read at import into constants, for huggingface_hub's basic LFS transfer.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


@pytest.fixture
def hub():
    with FakeHub(token=TOKEN) as server:
        yield server
    assert server.threads() == []


def test_dry_run_lists_exactly_the_shipped_files_and_contacts_nothing(folder, saved_model, hub, no_token,
                                                                      monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # a request would be recorded (HF_HUB_OFFLINE=1 stays set too)
    result = push_folder(folder, "user/tiny", dry_run=True, remote_check=False)
    # What save_pretrained and the card wrote, plus the extras; none of the junk.
    expected = sorted([(name, os.path.getsize(saved_model / name)) for name in os.listdir(saved_model)] +
                      [(name, len(data)) for name, data in SHIPPED_EXTRA.items()])
    assert result == {"repo_id": "user/tiny", "revision": "main", "files": expected, "commit_url": None,
                      "pr_url": None, "dry_run": True}
    assert {"model.safetensors", "config.json", "README.md", "modeling_hf_mixers.py"} <= {n for n, _ in expected}
    assert hub.requests == []
    listing = format_files(expected).splitlines()
    assert listing[-1] == f"{len(expected)} files, {sum(s for _, s in expected):,} bytes"
    assert listing[0].split() == [f"{expected[0][1]:,}", expected[0][0]]


def test_push_uploads_every_file_via_lfs_to_a_new_branch(folder, hub, online, without_xet):
    """The CLI path: every check (the remote-code load included: a good folder passes), then create the repository
    and the branch, upload, commit; then the same push again."""
    dry = push_folder(folder, "user/tiny", dry_run=True, remote_check=False)["files"]
    result = push_folder(folder, "user/tiny", private=True, revision="v1", endpoint=hub.endpoint)
    assert result["files"] == dry and result["revision"] == "v1" and not result["dry_run"]
    assert result["commit_url"].startswith(f"{hub.endpoint}/user/tiny/commit/")

    assert hub.repos == {"user/tiny": {"name": "tiny", "organization": "user", "visibility": "private",
                                       "type": "model"}}
    assert hub.branches["user/tiny"] == {"main", "v1"}
    (commit,) = hub.commits
    assert (commit.repo_id, commit.revision, commit.summary) == ("user/tiny", "v1", "Upload tiny with hf-mixers")
    assert not set(commit.files) & set(commit.lfs_files)
    assert sorted(set(commit.files) | set(commit.lfs_files)) == [name for name, _ in dry]
    for name, data in commit.files.items():  # small text files: inline, base64, in the commit payload
        assert data == (folder / name).read_bytes(), name
    assert {"config.json", "README.md", "modeling_hf_mixers.py"} <= set(commit.files)
    assert set(commit.lfs_files) == {"model.safetensors"}  # weights: LFS, content-addressed by sha256
    data = (folder / "model.safetensors").read_bytes()
    assert commit.lfs_files["model.safetensors"] == (hashlib.sha256(data).hexdigest(), len(data))
    assert hub.lfs_objects[hashlib.sha256(data).hexdigest()] == data

    # upload_folder and then create_commit (the path without hf_xet) each have README.md's front matter validated.
    validated = [r.json() for r in hub.requests if r.path == "/api/validate-yaml"]
    assert validated and all(v == {"content": CARD, "repoType": "model"} for v in validated)
    paths = [path for _, path in hub.calls() if path != "/api/validate-yaml"]
    assert paths == ["/api/repos/create", "/api/models/user/tiny/branch/v1", "/api/models/user/tiny/preupload/v1",
                     "/user/tiny.git/info/lfs/objects/batch", f"/lfs-upload/{hashlib.sha256(data).hexdigest()}",
                     "/lfs-verify", "/api/models/user/tiny/commit/v1"]
    for request in hub.requests:  # the token goes as Bearer to the Hub, never to the (presigned) storage URL
        expected = None if request.path.startswith("/lfs-upload/") else f"Bearer {TOKEN}"
        assert request.headers.get("authorization") == expected, request.path

    # Again: the repository and the branch exist (exist_ok), the weights are already stored (no second PUT).
    before = len(hub.requests)
    push_folder(folder, "user/tiny", private=True, revision="v1", endpoint=hub.endpoint, remote_check=False)
    again = [path for _, path in hub.calls()[before:]]
    assert len(hub.commits) == 2 and not any(path.startswith("/lfs-upload/") for path in again)
    assert hub.commits[1].lfs_files == commit.lfs_files


def test_push_with_hf_xet_installed_to_main_at_hf_endpoint(folder, online, monkeypatch):
    """What a user runs by default: hf_xet installed, so upload_folder takes its streamed pipeline. This fake Hub
    answers "regular" for every file, so nothing goes to Xet storage and every file arrives in the commit."""
    from huggingface_hub.utils._runtime import is_xet_available

    assert is_xet_available()
    real_pipeline, pipelined = _upload_pipeline.pipelined_upload, []

    def spy(*args, **kwargs):
        pipelined.append(kwargs["revision"])
        return real_pipeline(*args, **kwargs)

    monkeypatch.setattr(_upload_pipeline, "pipelined_upload", spy)  # hf_api imports it at each call
    with FakeHub(lfs=False, token=TOKEN) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # set after huggingface_hub's import: push reads it
        result = push_folder(folder, "user/tiny", remote_check=False)
    assert hub.threads() == [] and pipelined == ["main"]
    assert [path for _, path in hub.calls()] == ["/api/repos/create", "/api/validate-yaml",
                                                 "/api/models/user/tiny/preupload/main",
                                                 "/api/models/user/tiny/commit/main"]
    assert result["revision"] == "main" and result["commit_url"].startswith(f"{hub.endpoint}/user/tiny/commit/")
    assert hub.repos["user/tiny"] == {"name": "tiny", "organization": "user", "type": "model"}  # org default kept
    assert not any("/branch/" in path for _, path in hub.calls())
    (commit,) = hub.commits
    assert commit.revision == "main" and not commit.lfs_files
    assert sorted(commit.files) == [name for name, _ in result["files"]]
    for name, data in commit.files.items():
        assert data == (folder / name).read_bytes(), name


@pytest.mark.parametrize("breakage, message", ids=[
    "no-card", "card-without-metadata", "card-without-library", "card-bad-yaml", "no-config", "no-weights",
    "truncated-weights", "index-with-missing-shard"], argvalues=[
    (lambda d: os.remove(d / "README.md"), r"no model card \(README\.md\)"),
    (lambda d: (d / "README.md").write_text("# Tiny\n\nNo metadata.\n"), r"README\.md: the card has no YAML front"),
    (lambda d: (d / "README.md").write_text("---\nlicense: mit\n---\n# Tiny\n"),
     r"front matter lacks library_name, pipeline_tag, tags"),
    (lambda d: (d / "README.md").write_text("---\nlibrary_name: [unclosed\n---\n"), r"front matter does not parse"),
    (lambda d: os.remove(d / "config.json"), r"tiny: no config\.json"),
    (lambda d: os.remove(d / "model.safetensors"), r"no \*\.safetensors weights"),
    (lambda d: _truncate(d / "model.safetensors"), r"tiny/model\.safetensors: the safetensors file does not load"),
    (lambda d: (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}'),
     r"index\.json: names shards that are not in the folder .*model-00002-of-00002\.safetensors"),
])
def test_refuses_a_folder_that_is_not_ready(folder, breakage, message):
    breakage(folder)
    with pytest.raises(PushError, match=message):
        push_folder(folder, "user/tiny", dry_run=True, remote_check=False)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_refuses_a_missing_folder_or_a_file(tmp_path):
    with pytest.raises(PushError, match="no such folder"):
        check_folder(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(PushError, match="not a folder"):
        check_folder(tmp_path / "file")


def test_refuses_offline_mode_and_a_missing_token_before_contacting_anything(folder, hub, online, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PushError, match="HF_HUB_OFFLINE is set .*unset it to push"):
        push_folder(folder, "user/tiny", endpoint=hub.endpoint, remote_check=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # set before huggingface_hub's import
    with pytest.raises(PushError, match="HF_HUB_OFFLINE is set .*unset it to push"):
        push_folder(folder, "user/tiny", endpoint=hub.endpoint, remote_check=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(PushError, match="no Hugging Face token: set the HF_TOKEN environment variable or run "
                                        "`hf auth login`"):
        push_folder(folder, "user/tiny", endpoint=hub.endpoint, remote_check=False)
    assert hub.requests == []


def test_unreachable_endpoint_and_rejected_token_name_the_endpoint(folder, hub, online):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(PushError, match=re.escape(f"could not reach the Hub at {closed} to push user/tiny")):
        push_folder(folder, "user/tiny", endpoint=closed, remote_check=False)
    with pytest.raises(PushError, match=re.escape(f"the Hub at {hub.endpoint} refused the push to user/tiny (check")):
        push_folder(folder, "user/tiny", endpoint=hub.endpoint, token="hf_wrong", remote_check=False)
    assert hub.repos == {} and hub.commits == []


def test_remote_code_check_refuses_a_folder_that_needs_hf_mixers(folder):
    os.remove(folder / "modeling_hf_mixers.py")
    with pytest.raises(PushError, match="remote-code load failed in a fresh process without hf_mixers") as error:
        check_folder(folder)
    assert "modeling_hf_mixers" in str(error.value) and "\n" not in str(error.value)  # one line: the child's cause



def test_cli_dry_run_lists_the_files_and_refusals_exit_2(folder, no_token, capsys, monkeypatch):
    assert cli_main(["push", "user/tiny", str(folder), "--dry-run"]) == 0  # all checks run
    captured = capsys.readouterr()
    assert "model.safetensors" in captured.out and "dry run: nothing uploaded to user/tiny" in captured.out
    assert ".DS_Store" not in captured.out and captured.err == ""
    monkeypatch.chdir(folder)  # DIR defaults to the current folder, as for `hf upload`
    assert cli_main(["push", "user/tiny", "--dry-run"]) == 0 and "model.safetensors" in capsys.readouterr().out
    # the old form still works, with one deprecation line
    assert cli_main(["push", str(folder), "--repo-id", "user/tiny", "--dry-run"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "hf-mixers push: warning: `push DIR --repo-id REPO_ID` is deprecated; write "
        f"`hf-mixers push user/tiny {folder}`"]
    assert cli_main(["push", "user/tiny", str(folder), "--repo-id", "user/tiny", "--dry-run"]) == 2
    assert "give the repository once" in capsys.readouterr().err
    os.remove(folder / "README.md")
    assert cli_main(["push", "user/tiny", str(folder), "--dry-run"]) == 2
    assert "no model card (README.md)" in capsys.readouterr().err


def test_cli_push_with_a_commit_message_and_as_a_pull_request(folder, hub, online, without_xet, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    assert cli_main(["push", "user/tiny", str(folder), "--commit-message", "first weights"]) == 0
    assert f"pushed to user/tiny@main: {hub.endpoint}/user/tiny/commit/" in capsys.readouterr().out
    assert cli_main(["push", "user/tiny", str(folder), "--create-pr", "--commit-message", "try this"]) == 0
    assert f"opened a pull request on user/tiny (against main): {hub.endpoint}/user/tiny/discussions/1" in \
        capsys.readouterr().out
    assert [(c.revision, c.summary, c.pull_request) for c in hub.commits] == [("main", "first weights", None),
                                                                              ("main", "try this", 1)]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a fault of the machine, not of the command: exit 3
    assert cli_main(["push", "user/tiny", str(folder)]) == 3
    assert "offline mode" in capsys.readouterr().err
