"""Imported by verl in every process via VERL_USE_EXTERNAL_MODULES (with verl_plugin, comma-separated): the FSDP and
FSDP2 language-model engines become the fused-lm_head engine of integrations/verl_engine.py."""

from osvl_kernels.integrations.verl_engine import register_fused_engine

register_fused_engine()
