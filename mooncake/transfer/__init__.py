"""Moving bytes between processes and machines: the transfer engine and the messenger.

`import mooncake.transfer` stays light; import the submodules you use
(`mooncake.transfer.engine`, `mooncake.transfer.messenger`).
"""

__all__: list[str] = []
