"""The bundled batching policies; importing this package registers every one of them."""
from policies import static, vllm  # noqa: F401

from testbed.policy import make_policy, registered  # noqa: F401
