"""The fatal-mode ablation (paper Table 3b): the exact expected push of each mode on a toy agent
(``mechanism``), the resumable GRPO runs and their greedy evaluations (``runs``), and the tables,
intervals and plots of docs/ablation.md (``report``); ``python -m osvl.study`` drives them."""
