"""A second host, on this one: put this folder on the ``PYTHONPATH`` of an msrun that stands for a node other than
the master. msrun starts the scheduler on the node whose addresses include ``--master_addr``
(``process_entity._api._is_local_ip``); with every node on one machine each would, and the second scheduler fails
to bind the master's port. Here that check answers as on another host: this msrun starts its workers only, and they
reach the master's scheduler over the loopback, as another node's would over the network.
"""

import wrapt


def _another_host(module) -> None:
    module._is_local_ip = lambda address: False


wrapt.register_post_import_hook(_another_host, "mindspore.parallel.cluster.process_entity._api")
