"""EAGLE speculative decoding on a DeepSeek-V3-architecture model, with and without spec decoding.

    python examples/eagle_deepseek.py                       # embedded default: a tiny model, CPU ok
    python examples/eagle_deepseek.py --checkpoint DIR      # any HF-format DeepSeek-V3 dir with an MTP layer
    python examples/eagle_deepseek.py --device cuda --backend triton_mla --cuda-graph

Prints the generated tokens, the mean accept length, tokens/s both ways and the speedup, and
checks that greedy spec decoding produced exactly the target's own greedy output.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.baseline import greedy_generate
from specdec.config import SpecConfig
from specdec.models import DeepseekMTP, DeepseekV3Config, DeepseekV3ForCausalLM
from specdec.models import load_deepseek, load_mtp
from specdec.worker import EagleWorker


def tiny_default(device: torch.device, dtype: torch.dtype) -> tuple[DeepseekV3ForCausalLM, DeepseekMTP]:
    """A small randomly initialised model with DeepSeek-V3's MLA dims (latent 512, rope 64)."""
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=16, q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, max_position_embeddings=2048,
    )
    target = DeepseekV3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    mtp = DeepseekMTP(cfg, target=target).to(device=device, dtype=dtype).eval()
    return target, mtp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="HF-format DeepSeek-V3 directory with an MTP layer (default: tiny model)")
    ap.add_argument("--backend", default=None, help="attention backend (default: torch_ref on CPU, triton_mla on CUDA)")
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    backend = args.backend or ("torch_ref" if device.type == "cpu" else "triton_mla")
    if args.checkpoint:
        target = load_deepseek(args.checkpoint, dtype, device)
        draft = load_mtp(args.checkpoint, dtype, device, target=target)
    else:
        target, draft = tiny_default(device, dtype)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (8 + 5 * i,), generator=g).tolist() for i in range(args.batch_size)]
    context = 64 * ((max(map(len, prompts)) + args.max_new_tokens + 4 * args.num_steps * max(args.topk, 2) + 63) // 64)
    cfg = SpecConfig(
        num_steps=args.num_steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens, attention_backend=backend,
        page_size=64 if device.type == "cuda" else 16, max_batch_size=args.batch_size, max_context_len=context,
    )

    with torch.inference_mode():
        greedy_generate(target, prompts, 2, backend=backend, page_size=cfg.page_size)  # warm-up: JIT, allocator
        _sync(device)
        start = time.perf_counter()
        baseline = greedy_generate(target, prompts, args.max_new_tokens, backend=backend, page_size=cfg.page_size)
        _sync(device)
        base_s = time.perf_counter() - start

        worker = EagleWorker(target, draft, cfg)
        if args.cuda_graph:
            from graphs.runner import GraphRunner

            GraphRunner(worker)
        start = time.perf_counter()
        reqs = worker.add_requests(prompts, args.max_new_tokens)
        accept: list[int] = []
        while worker.requests:
            accept += worker.step().accept_lens
        _sync(device)
        spec_s = time.perf_counter() - start

    outputs = [r.output for r in reqs]
    tokens = sum(map(len, outputs))
    for prompt, out in zip(prompts, outputs):
        print(f"prompt {prompt[:8]}... -> {out}")
    mean_accept = sum(accept) / max(len(accept), 1)
    print(f"backend {backend}, num_steps {cfg.num_steps}, topk {cfg.topk}, num_draft_tokens {cfg.num_draft_tokens}, device {device}")
    print(f"mean accept length: {mean_accept:.2f} drafted tokens/step ({mean_accept + 1:.2f} tokens/step emitted)")
    print(f"tokens/s: target-only {tokens / base_s:.1f}, spec {tokens / spec_s:.1f}, speedup {base_s / spec_s:.2f}x")
    print(f"lossless (spec == target-only greedy): {outputs == baseline}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
