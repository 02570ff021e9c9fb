"""The gateway's TCP connection path, one stage per module, each returning a value.

`conn` (the connection table) -> `flight` (the first flight: ClientHello or request head)
-> `route` (which way a decided flow goes) -> `names` (the tunnelling guards of a name
about to be resolved) -> `dial` (resolve, check, connect; or hand over to the inspector)
-> `start` (the relay's first bytes); `refuse` is the one exit of every denial and
`pipeline` runs the stages in order. `listener` opens and drains the listening sockets.
"""
