"""The Tasks extension (io.modelcontextprotocol/tasks): model, reducer, stores and runner."""
