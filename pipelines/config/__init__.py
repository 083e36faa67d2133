"""The project config: the YAML file parsed into typed settings, errors naming the file and the key."""
