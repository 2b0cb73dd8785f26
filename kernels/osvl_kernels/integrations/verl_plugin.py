"""Imported by verl in every process via VERL_USE_EXTERNAL_MODULES=osvl_kernels.integrations.verl_plugin:
registers osvl's policy loss and advantage estimator (see integrations/verl.py)."""

from osvl_kernels.integrations.verl import register_verl

register_verl()
