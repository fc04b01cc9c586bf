"""One process of a two-process run: which rows of a global batch of 8 it loads, and
whether the batch the devices hold, gathered from both processes, is the whole batch.
Prints a JSON line. Usage: batch_share.py PORT PROCESS_ID MODEL_AXIS_SIZE"""

import json
import sys

import numpy as np
import optax
from jax.experimental import multihost_utils

from levanter_core import distributed
from levanter_core.trainer.config import DistributedConfig, TrainerConfig
from levanter_core.trainer.mesh import make_mesh
from levanter_core.trainer.trainer import Trainer

port, process_id, model_axis_size = (int(a) for a in sys.argv[1:4])
distributed.initialize(
    DistributedConfig(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
)
config = TrainerConfig(train_batch_size=8, model_axis_size=model_axis_size)
trainer = Trainer(config, optax.sgd(0.1), lambda model, batch, *, key: (0.0, {}), mesh=make_mesh(config))
rows = trainer.local_rows(trainer.Batch)
whole = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
example = trainer.to_device(whole[rows], trainer.Batch)  # this process's rows only
gathered = multihost_utils.process_allgather(example.tokens.array, tiled=True)
print(json.dumps({"rows": rows.tolist(), "whole": bool((np.asarray(gathered) == whole).all())}), flush=True)
