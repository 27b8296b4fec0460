"""Rebuild `data_samples/clip_tokenizer/` (a Hugging Face CLIPTokenizer) offline from OpenAI CLIP's BPE file.

OpenAI's CLIP ships its byte-level BPE as `bpe_simple_vocab_16e6.txt.gz` (MIT licence); the `open_clip_torch`
wheel carries the same file. This script turns it into `vocab.json` + `merges.txt` exactly the way CLIP's
`simple_tokenizer.py` builds its vocabulary (256 byte symbols, the same 256 with `</w>`, 48,894 merges, then
`<|startoftext|>`=49406 and `<|endoftext|>`=49407: 49,408 tokens) and saves a `CLIPTokenizer` with
`save_pretrained`. Its ids match `openai/clip-vit-large-patch14` and the laion bigG tokenizer.

    pip download --no-deps open_clip_torch -d /tmp/oc          # the wheel only; nothing is installed
    python tools/make_clip_tokenizer.py /tmp/oc/open_clip_torch-*.whl data_samples/clip_tokenizer

The source may be the wheel, the extracted `.txt.gz`, or omitted when an `open_clip` package can be found on the path (it is located, never imported).
"""
from __future__ import annotations
import argparse, gzip, importlib.util, json, tempfile, zipfile
from pathlib import Path

BPE_NAME = "open_clip/bpe_simple_vocab_16e6.txt.gz"
N_MERGES = 49152 - 256 - 2  # CLIP keeps the first 48,894 merges of the file
BOS, EOS = "<|startoftext|>", "<|endoftext|>"

def bytes_to_unicode() -> dict[int, str]:
    "GPT-2/CLIP's reversible map from the 256 byte values to printable unicode characters."
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return dict(zip(printable + others, [chr(c) for c in printable] + [chr(256 + i) for i in range(len(others))]))

def read_bpe_text(source: str | Path | None) -> str:
    "Text of `bpe_simple_vocab_16e6.txt.gz` from a wheel, the `.gz` file, or a findable `open_clip` package."
    if source is None:
        spec = importlib.util.find_spec("open_clip")  # locates the package without importing it
        if spec is None: raise FileNotFoundError("open_clip not found: pass the wheel or the .txt.gz path")
        source = Path(spec.origin).parent/Path(BPE_NAME).name
    source = Path(source)
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as zf: data = zf.read(BPE_NAME)
    else: data = source.read_bytes()
    return gzip.decompress(data).decode("utf-8")

def clip_vocab_and_merges(bpe_text: str) -> tuple[dict[str, int], list[str]]:
    "CLIP's vocabulary (token → id) and merge list, built as OpenAI's `SimpleTokenizer.__init__` builds them."
    merges = bpe_text.split("\n")[1:N_MERGES + 1]  # line 0 is a version header
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in merges] + [BOS, EOS]
    return {t: i for i, t in enumerate(tokens)}, merges

def make_clip_tokenizer(out_dir: str | Path, source: str | Path | None = None, model_max_length: int = 77):
    """Write CLIP's `vocab.json` + `merges.txt` + `tokenizer_config.json` into `out_dir`; return the loaded tokenizer.

    These three files load as a `CLIPTokenizer` in transformers 4 and 5 (slow or fast); they are 1.5 MB, less than
    half of the `tokenizer.json` that `save_pretrained` would add, which transformers rebuilds from them in ~0.1 s."""
    from transformers import CLIPTokenizer
    out_dir = Path(out_dir); out_dir.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_vocab_and_merges(read_bpe_text(source))
    (out_dir/"vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out_dir/"merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    # transformers 5: CLIPTokenizer(vocab_file=...) silently builds a 2-token tokenizer; from_pretrained(dir) works.
    tok = CLIPTokenizer.from_pretrained(out_dir, model_max_length=model_max_length, bos_token=BOS, eos_token=EOS,
                                        pad_token=EOS, unk_token=EOS)
    with tempfile.TemporaryDirectory() as tmp:  # keep save_pretrained's config, drop its bulky tokenizer.json
        tok.save_pretrained(tmp)
        config = json.loads((Path(tmp)/"tokenizer_config.json").read_text())
    for k in ("is_local", "local_files_only"): config.pop(k, None)  # facts about this machine, not the tokenizer
    (out_dir/"tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok = CLIPTokenizer.from_pretrained(out_dir)
    if len(tok) != 49408: raise ValueError(f"expected 49408 tokens, built {len(tok)}")
    return tok

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", nargs="?", help="open_clip_torch wheel or bpe_simple_vocab_16e6.txt.gz")
    ap.add_argument("out_dir", nargs="?", default=str(Path(__file__).resolve().parents[1]/"data_samples/clip_tokenizer"))
    args = ap.parse_args()
    tok = make_clip_tokenizer(args.out_dir, args.source)
    print(f"saved {len(tok)}-token CLIPTokenizer to {args.out_dir}:", tok("a photo of a cat").input_ids)
