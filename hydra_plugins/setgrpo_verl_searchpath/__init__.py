"""Hydra search-path plugin of setgrpo-verl: makes ``--config-name setgrpo_trainer`` resolve in any Hydra app.

Hydra imports every module of the ``hydra_plugins`` namespace package and calls each
:class:`~hydra.plugins.search_path_plugin.SearchPathPlugin` while it builds the config search path, so

    python -m verl.trainer.main_ppo --config-name setgrpo_trainer algorithm.setgrpo.beta=0.1 ...

finds ``setgrpo_trainer.yaml`` (edited in the repository's top-level ``hydra_configs/``, installed as the package
``setgrpo_verl.hydra_configs``) without ``--config-path``. The entry is appended, so
the application's own config directory (verl's ``verl/trainer/config``) keeps precedence for every name it has.
This module imports only Hydra.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

#: The search-path entry this plugin adds (the package that holds ``setgrpo_trainer.yaml``).
SEARCH_PATH = "pkg://setgrpo_verl.hydra_configs"


class SetGRPOSearchPathPlugin(SearchPathPlugin):
    """Appends :data:`SEARCH_PATH` (provider ``setgrpo-verl``) to every Hydra app's config search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="setgrpo-verl", path=SEARCH_PATH)
