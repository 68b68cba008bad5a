"""``tide generate`` through its console entry point (``deploy.cli.main``), run in this process:
its output equals the model computed alone, bad arguments name the value."""

from __future__ import annotations

import json

import pytest
import torch

from model.checkpoint import load_model
from model.generate import generate
from tests.cli import tide_here
from tests.model.hf_checkpoints import make_hf_checkpoint


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    ckpt = tmp_path_factory.mktemp("v3")
    make_hf_checkpoint("v3_grouped_yarn", ckpt)
    return ckpt


def test_penalized_and_biased_generation_matches_the_model(hf_ckpt, tmp_path):
    from model.sampling import SamplingParams

    model = load_model(hf_ckpt)
    penalized = generate(model, [5, 6, 7, 8], 12, SamplingParams(presence_penalty=2.0, frequency_penalty=1.0))
    banned = penalized[0]  # the bias must change the answer
    r = tide_here("generate", "--checkpoint", str(hf_ckpt), "--prompt-ids", "5,6,7,8", "--max-tokens", "12",
              "--presence-penalty", "2", "--frequency-penalty", "1", "--logit-bias", f"{banned}=-100",
              "--logit-bias", "3=1.5", "--json", env={"TIDE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    params = SamplingParams(presence_penalty=2.0, frequency_penalty=1.0, logit_bias=((banned, -100.0), (3, 1.5)))
    ids = generate(model, [5, 6, 7, 8], 12, params)
    assert json.loads(r.stdout)["token_ids"] == ids and banned not in ids


def test_json_object_mode_matches_the_model_under_the_masks(tmp_path):
    from model.default import default_checkpoint
    from model.grammar import Grammars, GrammarSpec
    from model.sampling import SamplingParams
    from model.tokenizer import ByteTokenizer

    r = tide_here("generate", "--prompt", "Reply in JSON", "--max-tokens", "40", "--json-object", "--logit-bias", "32=-10",
              "--logit-bias", "125=3", "--logit-bias", "44=-3", "--json", env={"TIDE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    tok = ByteTokenizer()
    model = load_model(default_checkpoint(tmp_path))
    ids = generate(model, [tok.BOS, *tok.encode("Reply in JSON")], 40,
                   SamplingParams(logit_bias=((32, -10.0), (125, 3.0), (44, -3.0))), eos_id=tok.EOS,
                   grammar=Grammars(tok.grammar_vocab(), model.cfg.vocab_size, [tok.EOS]).state(GrammarSpec("json_object")))
    out = json.loads(r.stdout)
    assert out["token_ids"] == ids and isinstance(json.loads(out["text"]), dict)


def test_generate_json_matches_the_model(hf_ckpt, tmp_path):
    r = tide_here("generate", "--checkpoint", str(hf_ckpt), "--prompt-ids", "5,6,7,8", "--max-tokens", "6",
              "--json", env={"TIDE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == generate(load_model(hf_ckpt), [5, 6, 7, 8], 6)
    assert isinstance(out["text"], str)


def test_generate_default_model_with_text_prompt(tmp_path):
    r = tide_here("generate", "--prompt", "Hello", "--max-tokens", "24", "--json", env={"TIDE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) <= 24
    assert not (tmp_path / "models").exists()  # the shipped, trained weights: nothing to make
    words = out["text"].split()
    assert len(words) >= 3 and all(w.isascii() for w in words)  # it writes (English-looking) words


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,x"], "1,x"),
        (["--prompt-ids", "1,99999"], "99999"),
        (["--prompt", "a", "--prompt-ids", "1"], "exactly one"),
        (["--prompt", "a", "--top-p", "0"], "top_p"),
        (["--prompt", "a", "--dtype", "int3"], "int3"),
        (["--prompt", "a", "--checkpoint", "/nonexistent"], "/nonexistent"),
        (["--prompt", "a", "--device", "tpu"], "tpu"),
        (["--prompt", "a", "--frequency-penalty", "3"], "frequency_penalty must be in [-2, 2], got 3.0"),
        (["--prompt", "a", "--logit-bias", "5"], "--logit-bias must be TOKEN_ID=BIAS, got '5'"),
        (["--prompt", "a", "--logit-bias", "5=300"], "logit_bias of token 5 must be in [-100, 100], got 300.0"),
    ],
)
def test_bad_arguments_name_the_bad_value(tmp_path, args, message):
    r = tide_here("generate", "--max-tokens", "2", *args, env={"TIDE_HOME": str(tmp_path)})
    assert r.returncode == 2
    assert message in r.stderr.replace("\n", " ").replace("│", "")


def test_seeded_sampling_is_reproducible(tmp_path):
    runs = [tide_here("generate", "--prompt-ids", "1,2,3", "--max-tokens", "5", "--temperature", "1.0",
                  "--seed", "11", "--json", env={"TIDE_HOME": str(tmp_path)}) for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert json.loads(runs[0].stdout) == json.loads(runs[1].stdout)
    torch.manual_seed(0)  # keep global RNG state irrelevant to the outcome


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = tide_here("generate", "--prompt-ids", "1,2", "--max-tokens", "2", "--device", "cuda", env={"TIDE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "CUDA is not available" in r.stderr


@pytest.mark.parametrize("shape", ["v32_sparse_yarn", "v4_hybrid_yarn"])
def test_current_families_generate_transformers_greedy_tokens(shape, tmp_path):
    """A V3.2 and a V4 checkpoint as transformers writes them: ``tide generate`` gives its greedy
    tokens for a prompt past the indexer's top-k and the compression windows."""
    ckpt = tmp_path / shape
    hf = make_hf_checkpoint(shape, ckpt, seed=7)
    prompt = torch.randint(0, hf.config.vocab_size, (90,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = hf.generate(prompt[None], attention_mask=torch.ones(1, 90, dtype=torch.long), max_new_tokens=24,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, 90:].tolist()
    r = tide_here("generate", "--checkpoint", str(ckpt), "--prompt-ids", ",".join(map(str, prompt.tolist())),
                  "--max-tokens", "24", "--json", env={"TIDE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == want


@pytest.mark.parametrize("family, runs", [("tiny", ("1", "0", "3")), ("tiny-v4", ("2", "0"))])
def test_greedy_output_is_the_same_with_and_without_mtp_drafts(tmp_path, family, runs):
    """A checkpoint with an MTP layer (V3's, V4's): `tide generate` drafting with it (one to three
    drafts a step) gives the model's own tokens, decoded a token at a time."""
    import dataclasses

    from model.checkpoint import random_state_dict, save_checkpoint
    from model.config import named_config

    cfg = dataclasses.replace(named_config(family), num_nextn_predict_layers=1)
    ckpt = save_checkpoint(tmp_path / "mtp", cfg, random_state_dict(cfg, seed=21, std=0.1))
    outs = []
    for drafts in runs:
        r = tide_here("generate", "--checkpoint", str(ckpt), "--prompt-ids", "5,6,7,8,9", "--max-tokens", "24",
                      "--speculative-tokens", drafts, "--json", env={"TIDE_HOME": str(tmp_path)})
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout)["token_ids"])
    assert all(out == generate(load_model(ckpt), [5, 6, 7, 8, 9], 24) for out in outs)
