"""The integration tests' actors never use torch (those that send a tensor import it then), so
their warm procs import nothing while they wait; `test_pool` checks the default imports in a
pool of its own."""

from tests.conftest import warm_procs_import

_warm_procs_import_nothing = warm_procs_import("")
