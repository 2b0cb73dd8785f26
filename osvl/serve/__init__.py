"""The service side of a GRPO run: what the trainer's rollouts talk to and how it is checked and started.

``engines``: the engine the rollouts call and how the trainer's weights reach it; ``plan``: the
servers' memory and weight-sync traffic (``osvl.train --dry-run``); ``preflight``: the stage's probes
of every service before step 1; ``commands``: the per-node commands of a cluster run;
``loopback_services`` and ``supervisor``: the CPU form on one machine, kept up, whose stand-ins are
``loopback_engine`` (SGLang's protocol over the local engine) and ``loopback_judge`` (``stand_in``: what
they share). ``python -m osvl.serve`` prints the commands or launches the CPU form.
"""
