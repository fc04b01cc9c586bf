"""Entry point of levanter-optim-contrib (see ``pyproject.toml``).

Each type is registered by its import path, so a module is imported only when a config names
its optimizer.
"""

from levanter_core.plugins import hookimpl

OPTIMIZERS = {
    "sophia-h": "levanter_optim_contrib.sophia:SophiaHConfig",
    "sophia-g": "levanter_optim_contrib.sophia:SophiaGConfig",
    "muon": "levanter_optim_contrib.muon:MuonConfig",
    "scion": "levanter_optim_contrib.scion:ScionConfig",
    "soap": "levanter_optim_contrib.soap:SoapConfig",
    "kron": "levanter_optim_contrib.kron:KronConfig",
    "mars": "levanter_optim_contrib.mars:MarsConfig",
    "mini": "levanter_optim_contrib.adam_mini:MiniConfig",
    "rmnp": "levanter_optim_contrib.rmnp:RmnpConfig",
}
"""``type:`` name -> config class. The names are Levanter's."""


@hookimpl
def register_optimizers(register):
    for name, target in OPTIMIZERS.items():
        register(name, target)
