"""Hydra configs of setgrpo-verl (``setgrpo_trainer.yaml``).

Edited here, in the repository's top-level ``hydra_configs/``, and installed as the package
``setgrpo_verl.hydra_configs`` (``package-dir`` in ``pyproject.toml``), so that ``pkg://setgrpo_verl.hydra_configs``
resolves from a wheel and from an editable install (see ``hydra_plugins/setgrpo_verl_searchpath``).
"""
