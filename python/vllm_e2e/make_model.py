"""Makes a tiny Llama for the vLLM prefill/decode check, offline.

Random weights from a fixed seed and a word-level tokenizer built here with
`tokenizers`: no model hub is needed. The model is too small to say anything
sensible; what the check needs is that its greedy output depends on every
prompt token, so that a decode which did not use the transferred KV (or used
the wrong bytes) produces different tokens.

`--bench` makes the benchmark's model instead (kvmove_bench.py): more and
wider layers (8 of 256, 8 KiB of float32 KV a token), so that a layer's
prefill takes milliseconds on this CPU, and positions for 4k-token prompts.

    python make_model.py OUT_DIR [--seed N] [--bench]

`--seed` changes the weights (the control run serves a prefill with other
weights and expects the decode's tokens to differ from the reference).
"""

import argparse
import json
import os

WORDS = (
    "the a an of to in on for with from by at as is was are were be been "
    "cache key value page layer block token prefill decode transfer engine "
    "memory host device network socket request batch slice lane rail peer "
    "server client model weight tensor attention head hidden vector "
    "one two three four five six seven eight nine ten "
    "red green blue black white small large fast slow early late "
    "river mountain forest ocean city village garden bridge tower road"
).split()


def build_tokenizer(out_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    # Filler tokens so the vocabulary is not tiny (the model's output
    # distribution then has room to differ between runs).
    while len(vocab) < 512:
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "model_max_length": 8192,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=1,
        )
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
            f,
        )
    return len(vocab)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bench", action="store_true", help="the benchmark's larger model")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab_size = build_tokenizer(args.out_dir)
    torch.manual_seed(args.seed)
    size = (
        dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=8192)
        if args.bench
        else dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)
    )  # fmt: skip
    config = LlamaConfig(
        vocab_size=vocab_size,
        **size,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config)
    # Larger weights than the default init so the logits are far apart:
    # greedy decoding is then decided by the inputs, not by rounding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model = model.to(torch.bfloat16)
    model.save_pretrained(args.out_dir, safe_serialization=True)
    with open(os.path.join(args.out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, f)
    print(f"tiny llama in {args.out_dir}: vocab {vocab_size}, seed {args.seed}")


if __name__ == "__main__":
    main()
