"""The flight recorder's old address: it lives in ncclavg/transport/flight.py. Programs written against
`ncclavg.comm.flight.dump(...)` keep working: this name is that module itself, not a copy."""
import sys

from ..transport import flight as _flight

sys.modules[__name__] = _flight
