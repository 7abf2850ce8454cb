"""Errors a caller can cause, as plain exceptions of the pure core.

The core (engine, sampling, orchestration) imports no grpc; each service maps
these to a gRPC status with the same message (see `specdec.rpc.grpc_errors`).
Anything else that escapes the core is a bug of ours and becomes INTERNAL.
"""


class SpecdecError(Exception):
    """Base of the errors a caller can cause; the message is shown to the user."""


class InvalidArgument(SpecdecError, ValueError):
    """The request itself is malformed (INVALID_ARGUMENT)."""


class NotFound(SpecdecError, LookupError):
    """Unknown or expired session, unknown model (NOT_FOUND)."""


class OutOfRange(SpecdecError):
    """A length beyond what the session or context holds (OUT_OF_RANGE)."""


class ResourceExhausted(SpecdecError):
    """A session, context or memory limit was reached (RESOURCE_EXHAUSTED)."""


class FailedPrecondition(SpecdecError):
    """The system is not in a state to serve the call (FAILED_PRECONDITION)."""


class Aborted(SpecdecError):
    """The call lost a race with another call of the same caller: a Propose
    that reached the draft after a newer one on its session (ABORTED)."""


class Unavailable(SpecdecError):
    """A downstream service cannot be reached (UNAVAILABLE)."""


class DeadlineExceeded(SpecdecError):
    """The request's deadline passed (DEADLINE_EXCEEDED)."""


class Unauthenticated(SpecdecError):
    """A credential is required and missing or wrong (UNAUTHENTICATED, HTTP 401).
    The API-key checks of the front doors answer it themselves
    (specdec.rpc.auth, orchestrator.openai_api.app)."""
