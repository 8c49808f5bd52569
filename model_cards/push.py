"""``hf-mixers push``: check a saved model folder, then create its Hub repository and upload it.

The flow of ``push_folder``:

1. Without ``dry_run``: refuse offline mode and a missing token first (cheap, before the slow checks).
2. ``check_folder``: list the files that would be uploaded (``list_upload_files``: every file under the folder
   minus ``IGNORE_PATTERNS``), then refuse a folder without a card with metadata, without config.json, without
   loadable safetensors weights, or whose remote code does not load where hf_mixers is not installed.
3. ``dry_run``: return that list; nothing is contacted and no token is needed.
4. Otherwise, with huggingface_hub's ``HfApi``: ``create_repo`` (exist_ok), ``create_branch`` for a revision other
   than main, then ``upload_folder`` with the same ignore patterns, so the files committed are the dry-run list.
   huggingface_hub shows its own progress bars. A connection failure or an HTTP error becomes a ``PushError``
   naming the endpoint.
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path

from ..common.folder import FolderError, check_model_weights

# Never shipped. Patterns are matched by huggingface_hub's ``filter_repo_objects`` (fnmatch on the path relative
# to the folder, where ``*`` also matches "/"), here and in ``upload_folder``, so the two lists agree.
IGNORE_PATTERNS = (
    ".*", "*/.*",  # hidden files and folders at any depth: .git, .cache, .DS_Store, .out.partial-* staging folders
    "__pycache__/*", "*/__pycache__/*", "*.pyc", "*.pyo",  # compiled Python next to the remote-code files
    "checkpoint*/*", "*/checkpoint*/*",  # training checkpoints: a folder named checkpoint*, not a file
)
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of boolean environment variables


class PushError(Exception):
    """A folder that is not ready to push, or a push that cannot be done; the message says what and where.
    ``fault``: the machine, not the command, is at fault (offline, no token, the Hub unreachable or refusing)."""

    def __init__(self, message: str, fault: bool = False):
        super().__init__(message)
        self.fault = fault


def list_upload_files(folder) -> list[tuple[str, int]]:
    """(relative posix path, size in bytes) of every file ``upload_folder`` uploads from ``folder``, sorted."""
    from huggingface_hub.utils import filter_repo_objects

    root = Path(folder).expanduser().resolve()
    # The same walk as HfApi._prepare_upload_folder_additions: recursive glob, files only (symlinks followed).
    paths = {path.relative_to(root).as_posix(): path for path in root.glob("**/*") if path.is_file()}
    kept = filter_repo_objects(sorted(paths), ignore_patterns=list(IGNORE_PATTERNS))
    return [(name, paths[name].stat().st_size) for name in kept]


def format_files(files: list[tuple[str, int]]) -> str:
    """The dry-run listing: one ``size  path`` line per file, then the total."""
    width = max([len(f"{size:,}") for _, size in files] + [1])
    lines = [f"{size:>{width},}  {name}" for name, size in files]
    lines.append(f"{len(files)} files, {sum(size for _, size in files):,} bytes")
    return "\n".join(lines)


def check_folder(folder: str, remote_check: bool = True) -> list[tuple[str, int]]:
    """Refuse a folder that is not ready; return the files that would be uploaded (relative path, size in bytes),
    sorted. ``remote_check=False`` skips only the (slow) remote-code load in a fresh process."""
    root = Path(folder).expanduser()
    if not root.exists():
        raise PushError(f"{folder}: no such folder")
    if not root.is_dir():
        raise PushError(f"{folder}: not a folder (push takes a saved model folder)")
    files = list_upload_files(root)
    names = {name for name, _ in files}
    _check_card(root, names)
    config = _check_config(root, names)
    _check_weights(root, names)
    if remote_check:
        _check_remote_code(root, config)
    return files


def _check_card(root: Path, names: set) -> None:
    """The card must exist and carry the metadata the Hub needs (card.check_card: one definition of that)."""
    from .card import CardError, check_card

    if "README.md" not in names:
        raise PushError(f"{root}: no model card (README.md); write one with `hf-mixers card {root}` before pushing")
    try:
        check_card(str(root / "README.md"))
    except CardError as error:
        raise PushError(str(error)) from None


def _check_config(root: Path, names: set) -> dict:
    if "config.json" not in names:
        raise PushError(f"{root}: no config.json; save the model with save_pretrained")
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise PushError(f"{root / 'config.json'}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise PushError(f"{root / 'config.json'}: not a JSON object")
    return config


def _check_weights(root: Path, names: set) -> None:
    if not any(name.endswith(".safetensors") and "/" not in name for name in names):
        raise PushError(f"{root}: no *.safetensors weights at the top of the folder")
    tensors = {name: _read_safetensors(root / name) for name in sorted(names) if name.endswith(".safetensors")}
    for index in sorted(name for name in names if name.endswith(".safetensors.index.json")):
        _check_index(root, index, tensors)
    try:  # every tensor readable is not enough: the config's model must find each of its tensors, shaped right
        check_model_weights(str(root))
    except FolderError as error:
        raise PushError(str(error)) from None


def _read_safetensors(path: Path) -> set:
    """Open the file and read every tensor (a truncated or corrupt file fails here); returns the tensor names."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            for key in keys:
                handle.get_tensor(key)
    except Exception as exc:  # SafetensorError, OSError, ...: the message is what matters
        raise PushError(f"{path}: the safetensors file does not load ({type(exc).__name__}: {exc})") from exc
    return keys


def _check_index(root: Path, index: str, tensors: dict) -> None:
    path = root / index
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PushError(f"{path}: not a safetensors index with a weight_map ({exc!r})") from exc
    folder = posixpath.dirname(index)
    missing = sorted({shard for shard in weight_map.values() if posixpath.join(folder, shard) not in tensors})
    if missing:
        raise PushError(f"{path}: names shards that are not in the folder (or are ignored): {', '.join(missing)}")
    absent = [name for name, shard in weight_map.items() if name not in tensors[posixpath.join(folder, shard)]]
    if absent:
        raise PushError(f"{path}: {len(absent)} tensors are not in the shard it names, e.g. {absent[0]}")


def _check_remote_code(root: Path, config: dict) -> None:
    """Load the folder as a Hub user without hf_mixers would (trust_remote_code, hf_mixers imports blocked)."""
    import torch

    from ..common.remote_check import load_in_fresh_process

    vocab_size = int(config.get("vocab_size") or 8)
    input_ids = (torch.arange(1, 5) % vocab_size).unsqueeze(0)
    pad_token_id = config.get("pad_token_id") or 0
    try:
        outputs = load_in_fresh_process(root, input_ids, max_new_tokens=2, pad_token_id=pad_token_id)
    except RuntimeError as exc:
        cause = str(exc).strip().splitlines()[-1]  # the child's exception, e.g. No module named 'mixers'
        raise PushError(f"{root}: the remote-code load failed in a fresh process without hf_mixers (what a Hub "
                        f"user gets with trust_remote_code=True); the folder is not self-contained: {cause}") from exc
    if not torch.isfinite(outputs["logits"]).all():
        raise PushError(f"{root}: the remote-code model loads but returns non-finite logits")


def _check_card_repo(root: Path, repo_id: str) -> None:
    """A card written by ``hf-mixers card --repo-id X`` loads X in its usage snippet (``repo = "X"``): refuse to push
    it to another repository, where that snippet would load the wrong model. A card without an id
    (``<user>/...``) or not written by hf-mixers passes."""
    import re

    written_for = re.findall(r'^repo = "([^"<>]+)"$', (root / "README.md").read_text(encoding="utf-8"), re.M)
    if written_for and written_for[0] != repo_id:
        raise PushError(f"{root / 'README.md'}: the card was written for {written_for[0]} (its usage snippet loads "
                        f"that repository), not {repo_id}: run `hf-mixers card {root} --repo-id {repo_id}` first")


def push_folder(folder, repo_id, private=False, revision=None, dry_run=False, token=None, endpoint=None,
                commit_message=None, remote_check=True, create_pr=False) -> dict:
    """Check ``folder`` and upload it to the model repository ``repo_id`` (created if needed) at ``revision``
    (default main; another branch is created from main), or opens a pull request against ``revision`` with
    ``create_pr``. Returns {"repo_id", "revision", "files", "commit_url", "pr_url", "dry_run"}; ``files`` is the
    uploaded list, ``commit_url`` and ``pr_url`` None when not made. Raises PushError."""
    from huggingface_hub import get_token

    from .card import CardError, check_repo_id

    try:  # the same rule the Hub applies, checked before anything else (a dry run too)
        check_repo_id(repo_id)
    except CardError as error:
        raise PushError(str(error)) from None
    revision = revision or "main"
    if not dry_run:
        _refuse_offline()
        token = token or get_token()
        if not token:
            raise PushError("no Hugging Face token: set the HF_TOKEN environment variable or run `hf auth login` "
                            "(a token with write access), or use --dry-run to only list the files", fault=True)
    files = check_folder(folder, remote_check=remote_check)
    _check_card_repo(Path(folder), repo_id)
    result = {"repo_id": repo_id, "revision": revision, "files": files, "commit_url": None, "pr_url": None,
              "dry_run": dry_run}
    if dry_run:
        return result
    endpoint = resolve_endpoint(endpoint)
    message = commit_message or f"Upload {Path(folder).resolve().name} with hf-mixers"
    try:
        result["commit_url"], result["pr_url"] = _upload(folder, repo_id, private, revision, token, endpoint, message,
                                                         create_pr)
    except Exception as exc:
        error = _as_push_error(exc, repo_id, endpoint)
        if error is None:
            raise
        raise error from exc
    return result


def resolve_endpoint(endpoint=None) -> str:
    """The Hub URL: ``endpoint``, else HF_ENDPOINT now, else huggingface_hub's default (HF_ENDPOINT at its import)."""
    from huggingface_hub import constants

    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _refuse_offline() -> None:
    from huggingface_hub import constants

    # huggingface_hub reads HF_HUB_OFFLINE once, at import, into constants.HF_HUB_OFFLINE, and its HTTP layer then
    # refuses every request; the environment is read too, for a variable set after that import.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").upper() in _TRUE:
            raise PushError(f"{name} is set (offline mode) and pushing needs the network; unset it to push "
                            f"(or use --dry-run to only list the files)", fault=True)
    if constants.HF_HUB_OFFLINE:
        raise PushError("HF_HUB_OFFLINE is set (or TRANSFORMERS_OFFLINE was, when huggingface_hub was imported: it is "
                        "in offline mode) and pushing needs the network; unset it to push (or use --dry-run to only "
                        "list the files)")


def _upload(folder, repo_id, private, revision, token, endpoint, message, create_pr=False) -> tuple[str, str | None]:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    # private=None, not False, when --private is not given: an organisation whose repos default to private keeps
    # that default (an explicit False would make the new repository public).
    api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
    if revision != "main" and not create_pr:  # a pull request goes against an existing revision
        api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
    # A fresh list: upload_folder appends its own defaults (.git, .cache/huggingface) to the list it is given.
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                             commit_message=message, ignore_patterns=list(IGNORE_PATTERNS), create_pr=create_pr)
    return info.commit_url, (info.pr_url if create_pr else None)


def _as_push_error(exc: Exception, repo_id: str, endpoint: str) -> PushError | None:
    """A PushError for a network failure or an HTTP error anywhere in the exception chain (huggingface_hub wraps
    some, e.g. a failed LFS upload in a RuntimeError); None for anything else."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    chain, cause = [], exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    for cause in chain:
        detail = f"{type(cause).__name__}: {cause}" if cause is exc else f"{exc} ({type(cause).__name__}: {cause})"
        if isinstance(cause, (ConnectionError, httpx2.TransportError)):
            return PushError(f"could not reach the Hub at {endpoint} to push {repo_id}: {detail}", fault=True)
        if isinstance(cause, HfHubHTTPError):
            status = cause.response.status_code if cause.response is not None else None
            hint = " (check that the token has write access to this namespace)" if status in (401, 403) else ""
            return PushError(f"the Hub at {endpoint} refused the push to {repo_id}{hint}: {detail}", fault=True)
    return None
