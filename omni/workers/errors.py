"""What can go wrong with the workers, as exceptions the driver reports."""


class WorkerFailure(RuntimeError):
    """A worker of the group died or raised; the group has been stopped."""


class ResourcesUnavailable(RuntimeError):
    """The machine or the Ray cluster cannot hold the workers asked for; names the keys."""
