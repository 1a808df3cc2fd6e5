"""From a config to a run: the config schemas and their check, the policies and routers a config names, and the one path that prepares and runs every backend."""
