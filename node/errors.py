"""The node's exception tree.

Every failure the node can explain to a volunteer is a ``NodeError`` with a one-line
message a person can act on. The CLI maps them to a non-zero exit and a clear line;
the agent loop maps them to events (``rejected``, ``error``) and a retry policy.

    NodeError
    ├── ConfigError          bad command-line value, unusable data dir
    │   └── DataDirBusy      another node process holds the data dir's lock
    ├── IdentityError        node key unreadable / wrong permissions
    ├── HubKeyMismatch       the hub's key is not the pinned one (refuse to work)
    │   └── HubForged        work signed by another key than the pinned one (refuse to work)
    ├── HubError             the hub answered with an error we cannot retry past
    │   ├── UnknownNode      401 unknown_node: re-register
    │   └── Banned           403 banned: stop
    ├── HubUnavailable       network error / 5xx: retry with backoff
    ├── AssignmentRejected   signature or fields of an assignment are wrong
    │   ├── BadSignature     the work answer is not signed by the pinned hub key
    │   └── RemovedSilo      it names a silo the operator removed (the hub is told to withdraw it)
    ├── BlobError            download failed verification (size / hash)
    ├── TrainError           the data or model does not fit the spec
    ├── TrainingStopped      should_stop() returned True between batches
    │   └── WorkersLost      a worker process of a multi-device node died (node/devices)
    ├── PipelineError        a pipeline stage cannot run its share of a step (node/pipeline)
    │   ├── StaleGeneration  the hub re-planned the pipeline: this stage's generation is over
    │   └── MessageLate      a message did not arrive within the time its receiver waits
    └── ControlError         the local control endpoint is unreachable / refused
"""

from __future__ import annotations


class NodeError(Exception):
    """Root of every error the node raises on purpose."""


class ConfigError(NodeError):
    """A command-line value or the data directory is unusable."""


class DataDirBusy(ConfigError):
    """Another node process is running with this data dir (it holds DIR/node.lock)."""


class IdentityError(NodeError):
    """The node's own key cannot be created or loaded."""


class HubKeyMismatch(NodeError):
    """The hub presents a key other than the pinned one."""


class HubForged(HubKeyMismatch):
    """A work answer carries a signature the pinned hub key did not make: someone forges the hub."""


class HubError(NodeError):
    """The hub refused a request; ``code`` is its error code, ``status`` the HTTP status."""

    def __init__(self, message: str, *, code: str = "", status: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class UnknownNode(HubError):
    """The hub does not know us (it restarted with a fresh database, or forgot us)."""


class Banned(HubError):
    """The hub has banned this node."""


class HubUnavailable(NodeError):
    """The hub could not be reached or answered 5xx; retry later."""


class AssignmentRejected(NodeError):
    """An assignment failed its signature check or its field checks; it is not trained."""


class BadSignature(AssignmentRejected):
    """The answer to a work request does not verify with the pinned hub key."""


class RemovedSilo(AssignmentRejected):
    """An assignment names a silo the operator removed from this node (``gpuflex-node data
    remove``): ``job_id`` and ``sha256`` say which, for the withdrawal the node sends the hub."""

    def __init__(self, message: str, *, job_id: str, sha256: str) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.sha256 = sha256


class BlobError(NodeError):
    """A downloaded blob is larger than declared or its sha256 does not match."""


class TrainError(NodeError):
    """The assignment's data or state does not fit its model spec."""


class TrainingStopped(NodeError):
    """Training stopped between batches because the node is pausing or exiting."""


class WorkersLost(TrainingStopped):
    """A worker process of a node that trains on several devices died; the assignment is handed
    back (its message is the reason the hub is told)."""


class ControlError(NodeError):
    """The local control endpoint refused the request or is not running."""


class PipelineError(NodeError):
    """A pipeline stage cannot run its share of a step: a bad cut or schedule, a neighbour's tensor
    of the wrong shape or dtype or holding NaN, a relay that refused, a neighbour that never sent."""


class StaleGeneration(PipelineError):
    """The hub answered 409 ``stale_generation``: the job's pipeline was re-planned (or ended), so
    this stage's generation is over. Not a failure: the stage stops and the node asks for work."""


class MessageLate(PipelineError):
    """A message did not arrive within the time its receiver waits: the sender is slow, stalled or
    gone. Distinct from a message that came and was refused, so a caller that can do without the
    sender (a mixture-of-experts router routing around a lost host) tells the two apart."""
