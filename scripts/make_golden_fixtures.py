#!/usr/bin/env python3
"""Produces Strata's golden fixtures with Hugging Face transformers and tokenizers.

Run where transformers >= 4.45 and tokenizers are installed (the GPU machine has them; the build machine does
not). Writes into OUT (default tests/fixtures):

  golden/<case>/   config.json, model.safetensors, tokenizer.json, expected.json
      expected.json = {case, arch, prompt_ids, logit_positions, logits (one row per listed position, float32
      from the float32 model), greedy_ids (32 greedy tokens, no EOS stop), min_greedy_gap, chunk_hint}
  tokenizer/<name>/ tokenizer.json, cases.json = [{text, ids, ids_special, decoded}]

Fixed seeds: a second run on the GPU machine reproduced every golden file byte for byte, but the tokenizers trainer
is not deterministic for the byte-fallback vocabularies (tie order), so the committed tokenizer fixtures are the
reference; regenerate only what changed. Keeps every fixture small (tiny models, vocab 320).
"""
import argparse
import json
import os
import sys

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = """Strata answers questions about long documents. A user uploads a document once and asks many
questions; answers stream back token by token. The quick brown fox jumps over the lazy dog. It's a truth
universally acknowledged that a single man in possession of a good fortune must be in want of a wife.
Numbers: 1, 22, 333, 4444, 55555, 3.14159, 2.71828, 1e-5, 0x1F, 2026-11-22. Code: def f(x):\n    return x ** 2
for i in range(10): print(i)  # comment\n\tindented with a tab\nWe're here; they'll come; you've seen; I'm done.
THE END OF THE BEGINNING. Café, naïve, résumé, Ångström, Zürich, façade. Привет, мир. Γειά σου κόσμε.
""" * 8

HARD_STRINGS = [
    "Hello world",
    "Hello, World! How are you?",
    "  leading spaces",
    "trailing spaces   ",
    "multiple     spaces    here",
    "tabs\tand\nnewlines\n\n\nend",
    "\r\n windows line endings\r\n",
    "numbers 1234567 and 3.14159 and 1 22 333 4444 55555",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "CJK 你好世界 日本語のテキスト 한국어",
    "accents café naïve Ångström",
    "decomposed cafe\u0301 and A\u030angstro\u0308m",
    "mixed CASE Words I'm you'RE it's DON'T we'LL",
    "code: def f(x):\n    return x**2  # comment",
    "special <|begin_of_text|> inside <|end_of_text|> text",
    "",
    " ",
    "\u00a0non-breaking\u00a0space",
    "a" * 60,
    "Zalgo z̷̢a̸l̵g̶o",
    "don't stop",
    "∑ ∫ √ ≤ ≥ ≠ ∞ → ←",
    "<s> and </s> and <unk> markers",
    "The quick brown fox jumps over the lazy dog.",
]


def train_bytelevel(pattern, specials, vocab_size, nfc, bos):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer=trainer)
    if bos:
        bos_id = tok.token_to_id(specials[0])
        tok.post_processor = processors.TemplateProcessing(single=f"{specials[0]} $A",
                                                           special_tokens=[(specials[0], bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def make_byte_fallback(metaspace):
    # Train on "▁"-normalised text, then rebuild the vocab Llama-2 style:
    # <unk>, <s>, </s>, <0x00>..<0xFF>, then the learned pieces; byte fallback for everything else.
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, limit_alphabet=60)
    base.train_from_iterator([CORPUS.replace("\n", " ")], trainer=trainer)
    learned = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def write_tokenizer_fixture(out_dir, name, tok):
    d = os.path.join(out_dir, "tokenizer", name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    cases = []
    for text in HARD_STRINGS + [CORPUS[:2000]]:
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_special = tok.encode(text, add_special_tokens=True).ids
        cases.append({"text": text, "ids": ids, "ids_special": ids_special,
                      "decoded": tok.decode(ids, skip_special_tokens=False)})
    with open(os.path.join(d, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=0)
    print(f"tokenizer/{name}: vocab {tok.get_vocab_size()}, {len(cases)} cases", file=sys.stderr)


def perturb_(model, seed):
    """Makes norms and biases non-trivial so that the fixtures test that they are applied."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def rope_kwargs(theta, scaling=None):
    """Rope settings in the spelling of the installed transformers (5.x: rope_parameters)."""
    import transformers
    if int(transformers.__version__.split(".")[0]) >= 5:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            params.update(scaling)
        return {"rope_parameters": params}
    out = {"rope_theta": theta}
    if scaling:
        out["rope_scaling"] = dict(scaling)
    return out


def make_golden(out_dir, case, arch, cfg_kwargs, tokenizer, prompt_len, seed, save_bf16=False, chunk_hint=8,
                logit_stride=1):
    import transformers
    torch.manual_seed(seed)
    cls_cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[arch]
    cls_model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[arch]
    base = dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                rms_norm_eps=1e-5, initializer_range=0.08, bos_token_id=tokenizer.token_to_id("<|begin_of_text|>"),
                eos_token_id=tokenizer.token_to_id("<|end_of_text|>"))
    base.update(cfg_kwargs)
    config = cls_cfg(**base)
    cfg_dict = config.to_dict()
    want = cfg_kwargs.get("rope_parameters", cfg_kwargs.get("rope_scaling"))
    if want and want.get("rope_type") == "llama3":
        text = json.dumps(cfg_dict)
        assert '"llama3"' in text, f"rope scaling not applied: {text}"
    model = cls_model(config).eval()
    perturb_(model, seed)
    if save_bf16:
        model = model.to(torch.bfloat16)
    d = os.path.join(out_dir, "golden", case)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    tokenizer.save(os.path.join(d, "tokenizer.json"))
    if save_bf16:
        # A fresh float32 model holding the bf16-rounded weights: casting the bf16 model back would also leave the
        # rotary inv_freq buffer rounded to bf16, which is not what a float32 engine computes.
        ref = cls_model(config).eval()
        ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        model = ref
    g = torch.Generator().manual_seed(seed + 7)
    prompt = torch.randint(0, config.vocab_size, (prompt_len,), generator=g).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
        # Greedy continuation with the full sequence re-run each step (no cache: the plainest reference).
        seq = list(prompt)
        greedy, gaps = [], []
        for _ in range(32):
            last = model(torch.tensor([seq])).logits[0, -1].float()
            top2 = torch.topk(last, 2).values
            gaps.append(float(top2[0] - top2[1]))
            nxt = int(torch.argmax(last))
            greedy.append(nxt)
            seq.append(nxt)
    positions = list(range(0, prompt_len, logit_stride))
    if positions[-1] != prompt_len - 1:
        positions.append(prompt_len - 1)
    expected = {
        "case": case, "arch": arch, "prompt_ids": prompt, "logit_positions": positions,
        "logits": [[float(f"{x:.7g}") for x in logits[p].tolist()] for p in positions],
        "greedy_ids": greedy, "min_greedy_gap": min(gaps), "chunk_hint": chunk_hint,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
    }
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(expected, f)
    print(f"golden/{case}: vocab {config.vocab_size}, prompt {prompt_len}, min greedy gap {min(gaps):.4g}",
          file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures")
    args = ap.parse_args()
    torch.set_num_threads(4)

    write_tokenizer_fixture(args.out, "bytelevel_llama3",
                            train_bytelevel(LLAMA3_PAT, ["<|begin_of_text|>", "<|end_of_text|>"], 1000, False, True))
    write_tokenizer_fixture(args.out, "bytelevel_qwen2",
                            train_bytelevel(QWEN2_PAT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 1000, True,
                                            False))
    write_tokenizer_fixture(args.out, "bpe_byte_fallback", make_byte_fallback(metaspace=False))
    write_tokenizer_fixture(args.out, "bpe_byte_fallback_metaspace", make_byte_fallback(metaspace=True))

    small_tok = train_bytelevel(LLAMA3_PAT, ["<|begin_of_text|>", "<|end_of_text|>"], 320, False, True)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    make_golden(args.out, "llama", "llama", rope_kwargs(10000.0), small_tok, 24, 1)
    make_golden(args.out, "llama3_scaled", "llama", rope_kwargs(500000.0, llama3), small_tok, 24, 2)
    make_golden(args.out, "llama_tied", "llama", dict(rope_kwargs(10000.0), tie_word_embeddings=True), small_tok, 24,
                3)
    make_golden(args.out, "qwen2", "qwen2", dict(rope_kwargs(1000000.0), use_sliding_window=False), small_tok, 24, 4)
    make_golden(args.out, "mistral", "mistral", dict(rope_kwargs(10000.0), sliding_window=None), small_tok, 24, 5)
    make_golden(args.out, "llama_bf16", "llama", rope_kwargs(10000.0), small_tok, 24, 6, save_bf16=True)
    make_golden(args.out, "llama_long", "llama", rope_kwargs(500000.0, llama3), small_tok, 300, 7, chunk_hint=64,
                logit_stride=23)


if __name__ == "__main__":
    main()
