import sys

from testbed.app.entry.commands import sim

sys.exit(sim())
