"""The `.shadefs` control directory: parsing, validation and dispatch, no business logic.

- `files`: the inodes, permissions and open handles; reads, and writes dispatched to
- `commands`: the `ctl` text commands, validated whole before any is applied;
- `channel`: the sampler's binary channel (`dataset`, `losses`, `order`), `residency`, `plan`;
- `entries`: the entries and the state of an open control file;
- `service`: `ControlService`, all that control sees of the daemon (a Protocol).
"""
