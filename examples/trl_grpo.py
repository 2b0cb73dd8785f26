"""GRPO with TRL's GRPOTrainer (1.16) and osvl's fused lm_head + GRPO loss: no [B, L, V] logits.

    python examples/trl_grpo.py                                  # tiny random Qwen2 on CPU, offline
    python examples/trl_grpo.py --model Qwen/Qwen3-0.6B --steps 200 --beta 0.04 --bf16

Everything TRL does (generation, rewards, advantages, reference and old log-probs, the vLLM
importance-sampling ratio) stays TRL's; only the trainer's loss hook `compute_loss` is osvl's,
installed after the trainer is built. The configuration below lists every GRPOConfig field the
fused loss reads; docs/integrations.md says what is supported and why.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from osvl_kernels.integrations.trl import OsvlFusedLinearGRPOLoss

WORDS = [f"w{i}" for i in range(40)]


def tiny_tokenizer():
    """A 42-token word-level tokenizer built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_policy(directory: Path, seed: int = 0) -> str:
    """Saves a random one-layer Qwen2 (hidden 16) to `directory` and returns its path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(WORDS) + 2,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return str(directory)


def count_reward(completions: list[str], **unused) -> list[float]:
    """Toy reward: how many distinct words the completion uses, scaled to [0, 1]."""
    return [len(set(c.split())) / 6.0 for c in completions]


def build_trainer(model: str, out_dir: str, tokenizer=None, prompts: list[str] | None = None, **config):
    """A GRPOTrainer with osvl's loss installed; `config` overrides the GRPOConfig fields below."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    settings = dict(
        output_dir=out_dir,
        loss_type="dapo",  # osvl: grpo, bnpo, dr_grpo, dapo
        beta=0.0,  # > 0 loads a reference model; the KL is k3, times pi/pi_old (use_bias_correction_kl)
        use_bias_correction_kl=True,  # TRL's default; only acts when beta > 0
        epsilon=0.2,
        epsilon_high=0.28,  # DAPO clip-higher
        delta=None,  # a float > 1 + epsilon_high bounds the ratio of negative-advantage tokens
        importance_sampling_level="token",  # "sequence" (GSPO) is refused
        temperature=1.0,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        # With use_vllm=True, TRL's vllm_importance_sampling_correction (default True) ratio reaches the
        # loss as vllm_is_ratio; osvl applies it to the policy-gradient term of each token, in every
        # vllm_importance_sampling_mode (sequence_mask by default, token_truncate, ...).
        use_vllm=False,
    )
    settings.update(config)
    dataset = Dataset.from_dict({"prompt": prompts or ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10 w11"]})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=count_reward,
        args=GRPOConfig(**settings),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    OsvlFusedLinearGRPOLoss.install(trainer)
    return trainer


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model id or path (default: a tiny random Qwen2, CPU-sized)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--loss-type", default="dapo", choices=["grpo", "bnpo", "dr_grpo", "dapo"])
    parser.add_argument("--bf16", action="store_true", help="bf16 policy with an fp32 lm_head (cast_lm_head_to_fp32)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="osvl_trl_")
    tokenizer = None
    model = args.model
    if model is None:
        model, tokenizer = tiny_policy(Path(out_dir) / "tiny_policy"), tiny_tokenizer()
    extra = dict(model_init_kwargs={"dtype": torch.bfloat16}, cast_lm_head_to_fp32=True) if args.bf16 else {}
    trainer = build_trainer(
        model, out_dir, tokenizer, max_steps=args.steps, beta=args.beta, loss_type=args.loss_type, **extra
    )
    result = trainer.train()
    print(f"osvl fused loss in TRL: {args.steps} steps, train_loss {result.training_loss:.4f}")
    return {"trainer": trainer, "train_loss": result.training_loss}


if __name__ == "__main__":
    main()
