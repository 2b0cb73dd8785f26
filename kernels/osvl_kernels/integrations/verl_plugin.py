"""Imported by verl in every process via VERL_USE_EXTERNAL_MODULES=osvl_kernels.integrations.verl_plugin:
registers osvl's policy loss and advantage estimator, and the "osvl_fatal_<mode>" v1 trainers that
feed the estimator its fatal flags (see integrations/verl.py)."""

import warnings

from osvl_kernels.integrations.verl import register_verl, register_verl_trainers

register_verl()
try:
    register_verl_trainers()
except ModuleNotFoundError as missing:  # verl's v1 trainer stack is not installed in this process
    warnings.warn(f"osvl_fatal_<mode> verl trainers not registered: {missing}", stacklevel=1)
