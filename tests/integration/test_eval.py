"""hf-mixers eval: held-out quality vs the teacher, passkey retrieval, samples, decode speed; lm-evaluation-harness."""

import json
import re

import pytest
import torch

from conftest import save_tiny_teacher
from hf_mixers.apps.cli import main as cli_main
from hf_mixers.conversion import convert
from hf_mixers.apps.eval_report import EvalReport, run_eval
from hf_mixers.common.measures import compare_to_teacher, passkey_accuracy, passkey_prompt

SMALL = dict(sequence_length=48, heldout_sequences=2, passkey_lengths=(160, 320), passkey_trials=2,
             prompts=("Write a line.",), max_new_tokens=6, decode_contexts=(64, 256), decode_tokens=3,
             progress=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Llama teacher folder and its RSA conversion (with its conversion report)."""
    root = tmp_path_factory.mktemp("eval")
    teacher = root / "teacher"
    tokenizer = save_tiny_teacher(teacher)
    student = root / "rsa"
    convert(str(teacher), "rsa", mixer_options={"rsa_num_slots": 8, "rsa_num_levels": 2}, out=str(student),
            sequence_length=64, calibration_sequences=2, heldout_sequences=1, progress=False)
    return {"teacher": teacher, "rsa": student, "tokenizer": tokenizer}


def test_passkey_prompt_fits_the_length_and_places_the_needle(folders):
    tokenizer = folders["tokenizer"]
    for length in (400, 800, 1600):
        for depth in (0.0, 0.5, 1.0):
            ids = passkey_prompt(tokenizer, length, depth, 31415)
            text = tokenizer.decode(ids)
            assert length - 60 <= len(ids) <= length, (length, len(ids))  # within one filler sentence
            assert text.count("31415") == 2 and text.rstrip().endswith("The pass key is")
            fillers = text.count("There and back again.")
            assert text[:text.index("31415")].count("There and back again.") == round(depth * fillers)
        assert fillers >= (length - 200) // 60  # the rest is filler


class _Answering:
    """A stand-in model whose greedy answer is the key read from its prompt, when ``knows(prompt)``, else 99999."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, knows):
        self.tokenizer, self.knows = tokenizer, knows

    def generate(self, ids, **kwargs):
        prompt = self.tokenizer.decode(ids[0])
        key = re.search(r"pass key is (\d+)", prompt).group(1)
        answer = f" {key}." if self.knows(prompt, key) else " 99999."
        extra = self.tokenizer(answer, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return torch.cat([ids, extra], dim=1)


def test_passkey_accuracy_scores_the_first_number_against_the_key(folders):
    tokenizer = folders["tokenizer"]
    always = passkey_accuracy(_Answering(tokenizer, lambda prompt, key: True), tokenizer, [200], trials=4,
                              progress=False)
    never = passkey_accuracy(_Answering(tokenizer, lambda prompt, key: False), tokenizer, [200], trials=4,
                             progress=False)
    # recalls only needles in the second half of the filler: exactly the two deepest of four depths
    def deep(prompt, key):
        return prompt[:prompt.index(key)].count("back again") > prompt.count("back again") / 2

    late = passkey_accuracy(_Answering(tokenizer, deep), tokenizer, [1600], trials=4, progress=False)
    assert always[200]["accuracy"] == 1.0 and never[200]["accuracy"] == 0.0 and late[1600]["accuracy"] == 0.5
    keys = [a["key"] for a in always[200]["answers"]]
    assert len(set(keys)) == 4 and all(10_000 <= k <= 99_999 for k in keys)
    assert always[200]["answers"][0]["answer"] == f"{keys[0]}."


def test_perplexity_without_a_teacher_matches_the_comparison(folders):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(folders["teacher"]).eval()
    model = AutoModelForCausalLM.from_pretrained(folders["rsa"]).eval()
    ids = torch.randint(1, 300, (2, 40))
    alone, both = compare_to_teacher(None, model, ids), compare_to_teacher(teacher, model, ids)
    assert set(alone) == {"student_perplexity"}
    assert alone["student_perplexity"] == pytest.approx(both["student_perplexity"], rel=1e-6)
    # and the perplexity is the exponentiated mean next-token cross-entropy
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]
    cross_entropy = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert alone["student_perplexity"] == pytest.approx(cross_entropy.exp().item(), rel=1e-4)


def test_eval_report_against_the_teacher(folders, tmp_path):
    report = run_eval(str(folders["rsa"]), out=str(tmp_path), **SMALL)  # teacher "auto": from the report
    assert report.teacher == str(folders["teacher"]) and "conversion_report.json" in report.notes[0]
    assert set(report.quality) == {"teacher_perplexity", "student_perplexity", "kl_teacher_student", "top1_agreement"}
    assert report.quality["kl_teacher_student"] >= 0 and 0 <= report.quality["top1_agreement"] <= 1
    assert [row["length"] for row in report.passkey] == [160, 320]
    assert all(row["prompt_tokens"] <= row["length"] and row["teacher_accuracy"] is not None for row in report.passkey)
    assert report.samples[0]["prompt"] == "Write a line." and isinstance(report.samples[0]["teacher"], str)
    short, long = report.decode
    assert short["model_cache_bytes"] == long["model_cache_bytes"]  # RSA: constant-size state
    assert long["teacher_cache_bytes"] == pytest.approx(4 * short["teacher_cache_bytes"], rel=0.05)  # KV grows
    assert all(row["model_tokens_per_s"] > 0 and row["teacher_tokens_per_s"] > 0 for row in report.decode)
    assert report.decode_step == "eager"  # as the folder's config runs it (compile_decode off)
    assert EvalReport.load(str(tmp_path)) == EvalReport(**json.loads(json.dumps(report.to_dict())))
    markdown = (tmp_path / "eval_report.md").read_text()
    for heading in ("## Held-out text", "## Passkey retrieval", "## Decoding", "## Samples"):
        assert heading in markdown
    assert f"| perplexity | {report.quality['student_perplexity']:.3f} | " in markdown


def test_eval_times_the_compiled_token_step_when_asked(folders, tmp_path):
    """--compile-decode: the decode rows time the model's compiled token step (what a server runs); the report and
    the card say which step ran (a report from before the field: eager)."""
    from hf_mixers.model_cards.card import evaluation_rows

    report = run_eval(str(folders["rsa"]), teacher=None, out=str(tmp_path), compile_decode=True, **SMALL)
    assert report.decode_step == "compiled (default)" and all(row["model_tokens_per_s"] > 0 for row in report.decode)
    assert "the model's token step compiled (default)" in (tmp_path / "eval_report.md").read_text()
    _, rows = evaluation_rows(None, None, report.to_dict())
    assert any("decode tokens/s after 64 tokens" in row[0] and "compiled (default)" in row[0] for row in rows)
    old = {key: value for key, value in report.to_dict().items() if key != "decode_step"}  # a report before the field
    assert any(row[0].endswith("token step eager)") for row in evaluation_rows(None, None, old)[1])
    with pytest.raises(ValueError, match="--compile-decode takes a torch.compile mode"):
        run_eval(str(folders["rsa"]), compile_decode="fastest", **SMALL)


def test_eval_without_a_teacher_and_its_errors(folders, tmp_path, capsys):
    report = run_eval(str(folders["rsa"]), teacher=None, out=str(tmp_path), **SMALL)
    assert report.teacher is None and set(report.quality) == {"student_perplexity"}
    assert all(row["teacher_accuracy"] is None for row in report.passkey)
    assert all(row["teacher_tokens_per_s"] is None and row["teacher_cache_bytes"] is None for row in report.decode)
    assert "KL" not in (tmp_path / "eval_report.md").read_text()
    # a context longer than the model's positions: the flag and the config field are named
    assert cli_main(["eval", str(folders["rsa"]), "--teacher", "none", "--passkey-lengths", "256,4096",
                     "--out", str(tmp_path / "x")]) == 2
    error = capsys.readouterr().err
    assert "--passkey-lengths [4096]" in error and "max_position_embeddings (512" in error
    assert cli_main(["eval", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_eval_holds_out_a_text_file_as_a_distillation_does(folders, tmp_path):
    """--data goes through distill's data path: a text file's last 20% as held-out blocks, named the same way."""
    from hf_mixers.recipes.dataset_sources import source_blocks

    text = tmp_path / "notes.txt"
    text.write_text("".join(f"Sentence number {i} of the notes.\n\n" for i in range(400)))
    report = run_eval(str(folders["rsa"]), teacher=None, data=str(text), out=str(tmp_path / "report"), **SMALL)
    held_out = source_blocks(str(text), folders["tokenizer"], 48, heldout_count=2, heldout_only=True)
    assert report.data == held_out.name == f"{text} (held out: the last 20% of its text)"
    assert report.heldout_sequences == 2 and held_out.train is None


def test_lm_evaluation_harness_runs_the_converted_model(folders, tmp_path):
    """`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` on a local task: its per-choice
    log-likelihoods equal ours, and its greedy generations equal model.generate's."""
    lm_eval = pytest.importorskip("lm_eval")  # installed by the test extra; absent only in a bare install
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    rows = [{"question": "To be, or not to", "choices": ["be", "sea", "king"], "answer": 0},
            {"question": "My kingdom for a", "choices": ["horse", "cup"], "answer": 0},
            {"question": "Now is the winter of our", "choices": ["discontent", "table"], "answer": 0}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'rows.jsonl'}\n"
              "test_split: test\ndoc_to_text: \"{{question}}\"\n")
    (tmp_path / "choice.yaml").write_text(
        "task: tiny_choice\n" + common + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (tmp_path / "generate.yaml").write_text(
        "task: tiny_generate\n" + common + "output_type: generate_until\ndoc_to_target: \"{{choices[0]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folders['rsa']},trust_remote_code=True,dtype=float32",
        tasks=["tiny_choice", "tiny_generate"], task_manager=TaskManager(include_path=str(tmp_path)), device="cpu",
        batch_size=2, log_samples=True)
    assert results["config"]["model_args"].startswith(f"pretrained={folders['rsa']}")

    model = AutoModelForCausalLM.from_pretrained(folders["rsa"], dtype=torch.float32).eval()
    tokenizer = folders["tokenizer"]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731 (lm-eval: no BOS)
    correct = 0
    for sample in results["samples"]["tiny_choice"]:
        ours = []
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            context_ids = encode(context)
            continuation_ids = encode(context + continuation)[len(context_ids):]  # lm-eval's _encode_pair
            ids = torch.tensor([context_ids + continuation_ids])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            ll = logp[len(context_ids) - 1:].gather(-1, torch.tensor(continuation_ids)[:, None]).sum().item()
            assert response[0][0] == pytest.approx(ll, abs=1e-3)
            ours.append(ll)
        correct += max(range(len(ours)), key=ours.__getitem__) == sample["doc"]["answer"]
    assert results["results"]["tiny_choice"]["acc,none"] == pytest.approx(correct / len(rows))

    for sample in results["samples"]["tiny_generate"]:
        ids = torch.tensor([encode(sample["arguments"][0][0])])
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
        ours = tokenizer.decode(tokens[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
        assert sample["resps"][0][0] == ours


def test_eval_runs_a_folders_own_code_only_when_asked(folders, tmp_path, capsys):
    """An hf-mixers folder loads through hf-mixers' own classes (its shipped remote code is not executed); a model
    type nobody here knows is refused by name unless --trust-remote-code."""
    import shutil

    from hf_mixers.apps.eval_report import load_model

    model, _ = load_model(str(folders["rsa"]), torch.float32, "cpu")
    assert type(model).__module__ == "hf_mixers.model.modeling"
    edited = tmp_path / "edited"
    shutil.copytree(folders["rsa"], edited)
    config = json.loads((edited / "config.json").read_text())
    config["model_type"] = "someone_elses"
    (edited / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert cli_main(["eval", str(edited), "--teacher", "none", "--out", str(tmp_path / "report")]) == 2
    error = capsys.readouterr().err
    assert "model_type 'someone_elses' is not a model transformers or hf-mixers knows" in error
    assert "HF_MIXERS_PLUGINS" in error and "--trust-remote-code" in error and error.count("\n") == 1
    (edited / "README.md").write_text("---\nlibrary_name: transformers\nlicense: apache-2.0\npipeline_tag: "
                                      "text-generation\ntags:\n- hf-mixers\n---\n\n# A card\n")
    for command in (["card", str(edited)], ["push", "user/x", str(edited), "--dry-run"]):  # one rule for all
        assert cli_main(command) == 2
        assert "model_type 'someone_elses' is not a model" in capsys.readouterr().err
