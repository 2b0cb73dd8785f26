"""A GRPO run in its own process, so a test can kill it (-9) and launch it again:

    python -m tests.trainer.grpo_job '["grpo.max_steps=4", ...]'

tiny_grpo with the overrides, the scripted policy (real logprobs) and the deterministic echo tools of
the resume test, in the local (in-process engine) form.
"""

from __future__ import annotations

import json
import sys


def main(overrides: list[str]) -> None:
    from osvl.config import load_recipe
    from osvl.trainer import run_grpo
    from tests.trainer.grpo_fixtures import scripted
    from tests.trainer.test_grpo_resume import deterministic_environment

    result = run_grpo(
        load_recipe("tiny_grpo", overrides), environment=deterministic_environment, engine_wrapper=scripted
    )
    print(f"steps {result.steps} resumed from {result.resumed_from}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
