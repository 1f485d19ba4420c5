pytest_plugins = ["pushactors.testing.fixtures"]
