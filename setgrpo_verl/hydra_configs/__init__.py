"""Hydra configs of setgrpo-verl (``setgrpo_trainer.yaml``); a package so that ``pkg://setgrpo_verl.hydra_configs``
resolves (see ``hydra_plugins/setgrpo_verl_searchpath``)."""
