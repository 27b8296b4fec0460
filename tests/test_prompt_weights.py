"""Prompt weighting and long prompts (issue 49) through the commands a user types: `(word:1.0)` samples exactly as
`word`, a weight changes the sample, a 150-token prompt samples (with a negative prompt of two chunks), `sample`,
`generate` and `eval` read the syntax, and a weight that is not a number is one line on stderr, exit 2, before any
model is loaded. The parser and the encoding themselves: nbs/22a_prompt_weights.ipynb (and the cases below)."""
import json
import pytest
import torch
from conftest import ROOT, run_cli

DEMO = ROOT / "configs" / "demo.yaml"
LONG = " ".join(["(red:1.2) apple"] * 75)   # 150 tokens, weighted: two chunks

@pytest.fixture(scope="module")
def random_run(tmp_path_factory):
    "A run directory with real (randomly initialised) tiny weights, whose evaluation captions are weighted prompts."
    from safetensors.torch import save_file
    from cascade_nb.config import load_config
    from cascade_nb.modes import build_generator
    run = tmp_path_factory.mktemp("run") / "demo"; run.mkdir()
    cfg = load_config(DEMO, [f"webdataset_path={ROOT / 'data_samples' / 'emoji'}",
                             'eval_captions=["a (red:1.3) apple", "[green] apple"]'])
    (run / "info.json").write_text(json.dumps({"config": cfg.to_yaml_dict(), "update": 2,
                                               "state_dir": "state-00000002"}))
    save_file(build_generator(cfg).state_dict(), run / "generator.safetensors")
    return run

@pytest.mark.parametrize("prompt, segments", [
    ("a (cat:1.3) sits", [("a ", 1.0), ("cat", 1.3), (" sits", 1.0)]),
    ("((cat))", [("cat", 1.21)]),
    ("[cat]", [("cat", round(1 / 1.1, 10))]),
    ("(a [b] (c:2))", [("a ", 1.1), ("b", 1.0), (" ", 1.1), ("c", 2.2)]),
    (r"\(cat\) \[dog\]", [("(cat) [dog]", 1.0)]),
    ("a (cat:1.0) sits", [("a cat sits", 1.0)]),
    ("a (b c", [("a ", 1.0), ("b c", 1.1)]),
    ("a ) b ]", [("a ) b ]", 1.0)]),
    ("(x: .5 )", [("x", 0.5)]),
    ("(x:-1e-1)", [("x", -0.1)]),
    ("a BREAK b", [("a", 1.0), ("BREAK", None), ("b", 1.0)]),
])
def test_the_parser(prompt, segments):
    from cascade_nb.prompt_weights import parse_prompt
    assert parse_prompt(prompt) == segments

def test_conditioning_bit_identical_changed_and_louder():
    from cascade_nb.models.clip import encode_text, load_clip_tokenizer, sample_tokenizer_dir, tiny_clip_text_model
    from cascade_nb.prompt_weights import encode_prompts
    tok, text_model = load_clip_tokenizer(sample_tokenizer_dir()), tiny_clip_text_model()
    plain = encode_text(tok, text_model, ["a photo of a cat"])
    same = encode_prompts(tok, text_model, ["a photo of a (cat:1.0)"])
    assert all(torch.equal(same[k], plain[k]) for k in plain)
    share = {}
    for w in (0.5, 1.5, 3.0):
        z = encode_prompts(tok, text_model, [f"a photo of a (cat:{w})"])["clip_text"][0]
        assert not torch.equal(z, plain["clip_text"][0])
        n = z.norm(dim=-1); share[w] = (n[5] / n.sum()).item()   # `cat`: position 5, after the start token
    assert share[0.5] < share[1.5] < share[3.0]
    long = encode_prompts(tok, text_model, [LONG, "a cat"])
    assert long["clip_text"].shape == (2, 154, 64) and long["clip_text_pooled"].shape == (2, 1, 64)

def test_a_150_token_prompt_samples_through_the_sample_cli(random_run, tmp_path):
    res = run_cli("-m", "cascade_nb.sample", "--checkpoint", random_run, "--prompt", LONG, "--prompt", "cactus",
                  "--negative-prompt", "green BREAK blurry", "--n", "1", "--steps", "2", "--cfg", "4",
                  "--out", tmp_path)
    assert "wrote 2 images" in res.stdout, res.stdout

def test_a_weight_of_one_samples_the_plain_prompt(random_run, tmp_path, capsys):
    from cascade_nb.sample import main
    def image(prompt, out):
        return main(["--checkpoint", str(random_run), "--prompt", prompt, "--n", "1", "--steps", "2",
                     "--out", str(tmp_path / out)])[0].read_bytes()
    assert image("a (red:1.0) apple", "one") == image("a red apple", "plain")
    # the run's conditioning (its random generator barely reads the text, so not its pixels)
    from cascade_nb.sample import load_run
    mode, _, _ = load_run(random_run)
    batch = {"images": torch.zeros(1, 3, 16, 16), "weighted": True}
    text = lambda p: mode.encode({**batch, "captions": [p]}, "cpu", training=False)[1]["clip_text"]
    assert torch.equal(text("a (red:1.0) apple"), text("a red apple"))
    assert not torch.equal(text("a (red:1.6) apple"), text("a red apple"))

def one_line_exit_2(run, capsys, *needles):
    "`run()` exits 2 with one line on stderr holding `needles`."
    with pytest.raises(SystemExit) as e: run()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and all(n in err[0] for n in needles), err

def test_a_weight_that_is_not_a_number_is_one_line(random_run, tmp_path, capsys):
    from cascade_nb.sample import main
    one_line_exit_2(lambda: main(["--checkpoint", str(random_run), "--prompt", "a (red:x) apple",
                                  "--out", str(tmp_path / "s")]),
                    capsys, "error: prompt 'a (red:x) apple': the weight 'x' of '(red:x)' is not a number")
    one_line_exit_2(lambda: main(["--checkpoint", str(random_run), "--prompt", "apple", "--negative-prompt", "(a:)",
                                  "--out", str(tmp_path / "s")]), capsys, "prompt '(a:)': the weight ''")
    assert not (tmp_path / "s").exists()

def test_sample_help_documents_the_syntax(capsys):
    from cascade_nb.sample import main
    with pytest.raises(SystemExit): main(["--help"])
    out = capsys.readouterr().out
    assert "(word:1.3)" in out and "BREAK" in out and "chunks of 75 tokens" in out

def test_generate_reads_the_syntax(tmp_path, capsys):
    from cascade_nb.inference import write_tiny_checkpoints
    from cascade_nb.generate import main
    models = write_tiny_checkpoints(tmp_path / "models")
    gen = ["--models", str(models), "--height", "64", "--width", "64", "--steps-c", "2", "--steps-b", "2",
           "--seed", "3", "--device", "cpu", "--no-previews"]
    assert main([LONG, "a (cat:0.8)", *gen, "--negative-prompt", "[blurry]", "--out", str(tmp_path / "o")]) == 0
    assert len(list((tmp_path / "o").glob("*.png"))) == 2
    assert main(["a (cat:1.0)", *gen, "--out", str(tmp_path / "w")]) == 0
    assert main(["a cat", *gen, "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "w" / "3_00_a-cat-1-0.png").read_bytes() == (tmp_path / "p" / "3_00_a-cat.png").read_bytes()
    capsys.readouterr()
    assert main(["a (cat:big)", *gen, "--out", str(tmp_path / "bad")]) == 2
    assert "error: prompt 'a (cat:big)': the weight 'big'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()

def test_eval_reads_listed_captions_as_prompts(random_run, capsys):
    from cascade_nb.eval import main
    results = main(["--checkpoint", str(random_run), "--metrics", "diversity", "--steps", "1"])
    assert "2 captions" in capsys.readouterr().out and set(results[str(random_run)]) >= {"diversity"}

def test_a_run_whose_text_encoder_trains_samples_weighted_prompts():
    "LoRA with train_tokens and text-encoder adapters conditions on token ids inside its net (`TokenInputs`)."
    from cascade_nb.config import config_from_dict
    from cascade_nb.modes import build_generator, build_text_encoder, PixelSpace
    from cascade_nb.gdf.presets import gdf_from_config
    from cascade_nb.lora_training import LoraTraining
    from cascade_nb.sample import sample_run
    cfg = config_from_dict(dict(experiment_id="x", webdataset_path=str(ROOT / "data_samples" / "emoji"),
                                model_version="tiny", model_overrides={"c_in": 3, "c_out": 3, "patch_size": 2},
                                latent_space="pixels", clip_text_model_name="tiny", clip_image_model_name=None,
                                image_size=16, module_filters=[".attn"], rank=4, text_encoder_adapter="lora",
                                train_tokens=[["[fernando]", "^dog</w>"]]))
    torch.manual_seed(0)
    tok, te = build_text_encoder(cfg)
    mode = LoraTraining(cfg, build_generator(cfg), tok, te, None, PixelSpace(), torch.float32)
    mode.set_training(mode.net, False)
    run = lambda prompts: sample_run(mode, gdf_from_config(cfg.gdf), cfg, prompts, n=1, steps=2, cfg_scale=3,
                                     net=mode.net)
    # the trained token is text inside a group; a weight of 1 is the plain caption's ids, bit for bit
    assert torch.equal(run(["a ([fernando]:1.0) emoji"]), run(["a [fernando] emoji"]))
    _, conds = mode.encode({"captions": ["a ([fernando]:1.3) emoji", LONG], "images": torch.zeros(2, 3, 16, 16),
                            "weighted": True}, "cpu", training=False)
    assert conds["input_ids"].shape == (4, 77) and conds["input_ids"][0, 2] == tok.convert_tokens_to_ids("[fernando]")
    assert torch.isfinite(run(["a ([fernando]:1.3) emoji", LONG])).all()
