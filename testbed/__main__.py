import sys

from testbed.app.commands import sim

sys.exit(sim())
