from moescope.agent.cli import entry

entry()
