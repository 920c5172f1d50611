"""Pipelined jobs: the model cut into stages on several nodes (docs/pipeline.md).

- ``offers``: the model cut into units (costs, boundary tensors, state entries) and the nodes' offers;
- ``planning``: the job's ``[pipeline]`` applied to the planner (stages, micro-batches, schedule,
  a re-plan keeping survivors on their units);
- ``generations``: a generation's relay plan and its stages' StageAssignments;
- ``checkpoints``: checkpoint steps, what a unit's state blob holds, the committed step;
- ``liveness``: when a stage is lost;
- ``joins``: when a node joining a running pipeline is worth a re-plan, and when to make it;
- ``resharding``: the unit state a re-plan moves, against what its nodes download;
- ``assembly``: the final model from the units' states;
- ``coordinator``: the ledger's ``pipelines`` room that runs them.
"""

from .coordinator import CheckpointTarget, Pipelines

__all__ = ["CheckpointTarget", "Pipelines"]
