"""Every cross-rank point of fzero: the communicators, their collectives, and shutdown.

Three communicators with one interface (``communicator.Communicator``): ``Comm``, the static view
of a process group that the step needs (``group``); ``HybridComm``, a 2-D ``("replicate",
"shard")`` device mesh (``hybrid``); and ``SimulatedComm``, any rank of any world size (or mesh)
on one device with no process group, for memory accounting (``simulated``). The engine takes any
of them (``zero1(group=...)``), and so can a test's recording subclass. The tensor collectives
are torch's functional collectives, traced into the compiled step; a ``Comm`` calls them through
a public table (``collectives``: on gloo, reduce-scatter and all-gather built from all-reduce and
broadcasts, which gloo runs faster) that a test or benchmark may wrap to count or log them.
``arrival`` checks, through the process group's store, that every rank reached the same
collective fzero call off the hot path; ``errors`` holds what all of them raise
(``CollectiveError``). ``teardown`` ends the process's use of torch.distributed (``fzero.shutdown``).
"""
from .teardown import shutdown  # first: it imports torch._dynamo before any process group exists (see there)
from .collectives import FUNCTIONAL, Collectives
from .communicator import Communicator, predivide_factor
from .errors import CollectiveError
from .group import Comm, resolve_group
from .hybrid import HybridComm, comm_of_mesh
from .simulated import SimulatedComm

__all__ = ["Comm", "HybridComm", "SimulatedComm", "Communicator", "Collectives", "FUNCTIONAL", "CollectiveError",
           "resolve_group", "comm_of_mesh", "shutdown", "predivide_factor"]
