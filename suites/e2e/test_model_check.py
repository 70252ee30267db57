"""The tiny GPT-OSS through registry backends: the oracle-MoE model answers its task, honest
backends pass every layer on the model's own activations, and planted catalogue faults fail at
the layer where they are planted, also where the model's output barely moves."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="the model-level checks need transformers (pip install transformers)")

from mxmoe.harness.cli.app import main  # noqa: E402
from mxmoe.harness.contract.backend import BackendUnavailable  # noqa: E402
from mxmoe.harness.contract.inputs import CaseInputs, make_inputs  # noqa: E402
from mxmoe.harness.contract.platforms import host_arch  # noqa: E402
from mxmoe.harness.e2e import task  # noqa: E402
from mxmoe.harness.e2e.checkpoint import (
    TINY_DIR,  # noqa: E402
    open_checkpoint,  # noqa: E402
)
from mxmoe.harness.e2e.layercheck import check_model  # noqa: E402
from mxmoe.harness.e2e.model import MoEModel, layer_case  # noqa: E402
from mxmoe.harness.e2e.tiny import accuracy  # noqa: E402
from mxmoe.harness.instruments.faults import mutant_specs  # noqa: E402
from mxmoe.harness.instruments.honest import Oracle  # noqa: E402
from mxmoe.harness.judge.bounds import tie_aware_bound  # noqa: E402
from mxmoe.harness.run.registry import discover, load_spec, select  # noqa: E402
from mxmoe.reference.moe import Precision  # noqa: E402

ARCH = host_arch()
"""The model runs where the suite runs: on the CPU here (portable-triton under Triton's
interpreter), on the GPU of a GPU host."""


@pytest.fixture(scope="module")
def tiny():
    ckpt = open_checkpoint("tiny")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_DIR / "tokenizer.json"))
    return ckpt, tok, MoEModel(ckpt, ARCH)


def _backend(ident):
    return select(discover(tuple(mutant_specs())), (ident,))[0]


def _batch(tok, n):
    rows = task.read_csv(TINY_DIR / "task-test.csv")[:n]
    seqs = []
    for row in rows:
        prompt, shown, correct = task.format_prompt(row)
        seqs.append(tok.encode(prompt + task.answer_text(shown[correct])).ids)
    return task.pad_batch(seqs, pad_id=0)


def test_the_oracle_moe_model_answers_the_task_far_above_chance(tiny):
    ckpt, tok, model = tiny
    model.use(_backend("oracle"))
    rows = task.read_csv(TINY_DIR / "task-test.csv")
    acc = accuracy(model.logits, lambda s: tok.encode(s).ids, rows, pad_id=0)
    recorded = json.loads((TINY_DIR / "fixture.json").read_text())["oracle_moe_test_accuracy"]
    print(f"oracle-MoE tiny GPT-OSS: {acc:.3f} on {len(rows)} held-out questions (chance 0.25)")
    # the record was made on a CPU; elsewhere (a GPU's attention) a question or two may tip
    assert acc >= 0.8 and acc == pytest.approx(recorded, abs=1e-9 if ARCH == "cpu" else 0.02)


def test_transformers_own_mxfp4_model_agrees_with_the_oracle_moe_model(tiny):
    """transformers loads the fixture through its own MXFP4 path (dequantized to bf16, its eager
    experts); its next-token distribution is the oracle model's up to bf16 rounding."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    ckpt, tok, model = tiny
    hf = GptOssForCausalLM.from_pretrained(
        TINY_DIR, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16, attn_implementation="eager"
    )
    ids, mask = _batch(tok, 8)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits.float()
    model.use(_backend("oracle"))
    ours = model.logits(ids)
    from mxmoe.harness.e2e.layercheck import compare_logits

    c = compare_logits(ours, theirs.to(ours.device), mask)
    assert c.top1_agreement >= 0.98 and c.kl_mean < 1e-3, c


@pytest.mark.parametrize("ident, batch", [("emulation", 8), ("honest-splitk", 8), ("portable-triton", 2)])
def test_honest_backends_pass_every_layer(tiny, ident, batch, tmp_path):
    ckpt, tok, model = tiny
    ids, mask = _batch(tok, batch)
    found = check_model(model, ids, mask, _backend(ident), _backend("oracle"), results=tmp_path)
    assert [v.layer for v in found.layers] == list(range(ckpt.shapes.layers))
    bad = [(v.layer, v.result.reason) for v in found.layers if v.result.outcome != "PASS"]
    assert not bad and found.passed and found.first_failure is None
    assert found.comparison.top1_agreement >= 0.98, found.comparison
    assert not (tmp_path / "repro").exists()  # reproducers are written for FAIL and ERROR only


PLANTED = [
    ("mutant-one-scale-byte", 2),  # subtle: the model's output barely moves
    ("mutant-missing-plus-one", 1),
    ("mutant-b2-dropped", 3),
    ("mutant-gate-up-swapped", 0),
    ("mutant-nibble-order", 2),
]


@pytest.mark.parametrize("fault, layer", PLANTED, ids=[f"{f.removeprefix('mutant-')}-layer{n}" for f, n in PLANTED])
def test_a_planted_fault_fails_at_its_layer_and_nowhere_else(tiny, fault, layer, tmp_path):
    ckpt, tok, model = tiny
    ids, mask = _batch(tok, 8)
    found = check_model(model, ids, mask, _backend("honest-fp32"), _backend("oracle"),
                        plants={layer: _backend(fault)}, results=tmp_path)  # fmt: skip
    outcomes = {v.layer: v.result.outcome for v in found.layers}
    assert found.first_failure == layer, outcomes
    assert all(o == "PASS" for n, o in outcomes.items() if n != layer), outcomes
    planted = found.layers[layer]
    assert planted.result.backend == fault and planted.repro is not None
    if fault == "mutant-one-scale-byte":
        # caught per layer although the model's answers do not change
        assert found.comparison.top1_agreement >= 0.99, found.comparison
        print(f"one scale byte at layer {layer}: top-1 agreement {found.comparison.top1_agreement:.4f}, "
              f"KL {found.comparison.kl_mean:.2e}, layer verdict {planted.result.reason}")


def test_breaking_real_routing_ties_the_other_way_is_not_a_fault(tiny):
    """The catalogue's control that breaks ties toward the higher index (as AITER does) as every
    layer's MoE: the model's real bf16 logits tie exactly at the top-k boundary on some tokens, and
    each layer still PASSes (a tied token is judged by the resolution its output is closer to)."""
    ckpt, tok, model = tiny
    ids, mask = _batch(tok, 8)
    found = check_model(model, ids, mask, _backend("mutant-ties-other-way"), _backend("oracle"))
    assert sum(v.tied_tokens for v in found.layers) >= 1
    assert found.passed, [(v.layer, v.result.reason) for v in found.layers]


def test_a_layer_reproducer_replays_to_the_same_verdict(tiny, tmp_path, capsys):
    ckpt, tok, model = tiny
    ids, mask = _batch(tok, 4)
    found = check_model(model, ids, mask, _backend("honest-fp32"), _backend("oracle"),
                        plants={1: _backend("mutant-missing-plus-one")}, results=tmp_path)  # fmt: skip
    repro = found.layers[1].repro
    assert repro is not None and repro.suffix == ".json"
    assert main(["replay", str(repro)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_the_model_check_command(tmp_path, capsys):
    rc = main(["model-check", "--model", "tiny", "--backend", "emulation", "--batch", "3", "--repeats", "1",
               "--results", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "first failing layer: none" in out and "top-1 agreement" in out and "forward (emulation" in out
    summary = json.loads((tmp_path / f"model-check-emulation-{ARCH}.json").read_text())
    assert summary["passed"] and len(summary["layers"]) == 4
    rc = main(["model-check", "--model", "tiny", "--backend", "honest-fp32", "--plant", "3=mutant-b2-dropped",
               "--batch", "2", "--repeats", "0", "--results", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1 and "first failing layer: 3" in out and "replay: python -m" in out


def test_the_synthetic_architecture_path_runs_end_to_end(tmp_path, capsys):
    """``random:NAME`` builds the architecture from a seed (random token ids, no tokenizer); the
    tiny shape keeps it CPU-sized: the same code that runs random:gpt-oss-20b on a GPU."""
    rc = main(["model-check", "--model", "random:gpt-oss-tiny", "--backend", "emulation", "--tokens", "96",
               "--repeats", "1", "--results", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "96 random token ids (no tokenizer)" in out and "first failing layer: none" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "tiny", "--backend", "no-such"], "--backend: --backend 'no-such' matches no backend"),
        (["--model", "tiny", "--backend", "emulation", "--plant", "two=emulation"], "expected LAYER=BACKEND_ID"),
        (["--model", "/nonexistent/gpt-oss", "--backend", "emulation"], "no such folder"),
        (["--model", "tiny", "--backend", "emulation", "--prompts", "/nonexistent.txt"], "--prompts: no such file"),
    ],
)
def test_model_check_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["model-check", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_backend_that_cannot_take_the_layer_says_why(tiny, tmp_path, capsys):
    ckpt, tok, model = tiny
    other = next(b for b in ("triton", "aiter-mxfp4-bf16") if ARCH not in _backend(b).backend.declaration.archs)
    with pytest.raises(BackendUnavailable, match=f"layer 0: {other} does not run on {ARCH}"):
        model.use(_backend(other))
    assert main(["model-check", "--model", "tiny", "--backend", other, "--results", str(tmp_path)]) == 2
    assert f"{other} does not run on {ARCH}" in capsys.readouterr().err


def test_a_layer_case_is_the_zoo_model_of_that_shape():
    assert layer_case(open_checkpoint("tiny").config, 5).id == "gptosstiny-interleaved-t5"
    assert layer_case(open_checkpoint("random:gpt-oss-20b").config, 7).id == "gptoss20b-interleaved-t7"
    assert layer_case(open_checkpoint("random:gpt-oss-120b").config, 1).id == "gptoss120b-interleaved-t1"


def test_an_exact_routing_tie_accepts_either_choice():
    """A token whose 2nd and 3rd logits tie exactly: the oracle takes the lower index; a kernel that
    takes the higher one is inside the widened band, and the token is counted."""
    base = make_inputs(layer_case(open_checkpoint("tiny").config, 4))
    logits = base.router_logits.clone()
    logits[1] = torch.tensor([0.0, 3.0, 1.0, -1.0, 1.0, -2.0, 0.5, -0.5])  # experts 2 and 4 tie for 2nd
    inputs = CaseInputs(base.case, base.x, logits, base.weights, None, None)
    arith = Oracle.declaration.arithmetic
    judge, tied = tie_aware_bound(inputs, arith)
    assert tied == 1 and callable(judge)
    other = logits.clone()
    other[1, 4] = torch.nextafter(other[1, 4], torch.tensor(2.0))  # the higher index wins the tie
    theirs = CaseInputs(base.case, base.x, other, base.weights, None, None).reference(Precision(output=torch.bfloat16))
    ours = inputs.reference(Precision(output=torch.bfloat16))
    assert not torch.equal(theirs, ours)  # the two resolutions differ
    for got in (ours, theirs):  # either passes, each against its own reference
        b = judge(got)
        assert ((got.double() - b.ref).abs() <= b.bound).all()
    mixed = theirs.clone()
    mixed[0] = ours[0] + 1  # an error on an untied token is still an error
    b = judge(mixed)
    assert ((mixed.double() - b.ref).abs() > b.bound)[0].any()




def test_a_backend_given_by_file_can_be_the_models_moe(tiny, tmp_path):
    path = tmp_path / "my_backend.py"
    path.write_text(
        "import dataclasses, torch\n"
        "from mxmoe.harness.instruments.honest import Oracle\n"
        "class Mine(Oracle):\n"
        "    declaration = dataclasses.replace(Oracle.declaration, id='my-moe', kind='backend')\n"
    )
    ckpt, tok, model = tiny
    ids, mask = _batch(tok, 2)
    found = check_model(model, ids, mask, load_spec(f"{path}:Mine"), _backend("oracle"))
    assert found.passed and found.backend == "my-moe"


def test_a_backend_that_crashes_loses_no_other_backends_results(tmp_path, capsys):
    """One backend raises inside a checked layer, another outside them (in an unchecked forward):
    each is reported with its summary (not PASS), and the backend after them is still checked."""
    path = tmp_path / "flaky.py"
    path.write_text(
        "import dataclasses\n"
        "from mxmoe.harness.instruments.honest import Oracle\n"
        "class AtLayer2(Oracle):\n"
        "    declaration = dataclasses.replace(Oracle.declaration, id='raises-at-layer2', kind='backend')\n"
        "    calls = 0\n"
        "    def run(self, prepared, inputs, out):\n"
        "        AtLayer2.calls += 1\n"
        "        if AtLayer2.calls > 4:  # layers 0 and 1 run twice each\n"
        "            raise RuntimeError('boom')\n"
        "        super().run(prepared, inputs, out)\n"
        "class AfterCheck(Oracle):\n"
        "    declaration = dataclasses.replace(Oracle.declaration, id='raises-after-check', kind='backend')\n"
        "    calls = 0\n"
        "    def run(self, prepared, inputs, out):\n"
        "        AfterCheck.calls += 1\n"
        "        if AfterCheck.calls > 8:  # the checked forward: 4 layers, twice each\n"
        "            raise RuntimeError('boom after')\n"
        "        super().run(prepared, inputs, out)\n"
    )
    rc = main(["model-check", "--model", "tiny", "--backend-file", f"{path}:AtLayer2", "--backend-file",
               f"{path}:AfterCheck", "--backend", "raises-at-layer2", "--backend", "raises-after-check",
               "--backend", "emulation", "--batch", "2", "--repeats", "1", "--results", str(tmp_path)])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 1
    assert "checked forward stopped: layer 2: the backend raised" in captured.out
    assert "checked forward stopped: an unchecked (timed) forward raised: RuntimeError: boom after" in captured.out
    assert "forward (emulation, unchecked)" in captured.out  # the backend after them ran
    after = json.loads((tmp_path / f"model-check-raises-after-check-{ARCH}.json").read_text())  # written all the same
    assert not after["passed"] and "boom after" in after["aborted"] and len(after["layers"]) == 4
    summary = json.loads((tmp_path / f"model-check-raises-at-layer2-{ARCH}.json").read_text())
    assert summary["first_failure"] == 2 and summary["layers"][2]["outcome"] == "ERROR"
    assert (tmp_path / f"model-check-emulation-{ARCH}.json").is_file()


def test_a_check_that_judged_no_layer_did_not_pass():
    from mxmoe.harness.e2e.layercheck import ModelCheck

    assert not ModelCheck(backend="x", planted={}, layers=[], comparison=None).passed
