"""Build a tiny random Llama and a byte-level BPE tokenizer, offline, for vLLM tests.

    python -m pushactors.testing.tiny_model OUT_DIR [--seed 0]

Needs ``transformers`` and ``tokenizers`` (they come with vLLM). About 1 MB, a few seconds.
Greedy decoding of the result is deterministic.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A prefill engine computes the key value cache and pushes it to a decode engine.",
    "Disaggregated serving splits prompt processing from token generation.",
    "Once upon a time there was a small model that lived on a CPU.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "The cache blocks are transferred layer by layer over the network.",
    "Hello world! How are you today? I am fine, thank you.",
    "In the beginning the engine allocates blocks, then the scheduler runs.",
    "Every request has an id, a prompt, and a list of sampled tokens.",
    "Python, Rust, C and Go are programming languages used for systems.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()[]{}",
]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tokenizer(out_dir: str, vocab_size: int = 512):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
    )
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: str, tokenizer, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg)
    # A wide random init, so greedy decoding depends visibly on every cached key and value.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)


def make(out_dir: str, seed: int = 0) -> None:
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    tok = build_tokenizer(out_dir)
    build_model(out_dir, tok, seed)
    print(f"tiny model written to {out_dir} (vocab {len(tok)}) in {time.time() - t0:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    make(args.out_dir, args.seed)


if __name__ == "__main__":
    main()
