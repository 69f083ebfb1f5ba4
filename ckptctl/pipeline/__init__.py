"""The update pipeline: grouping, coordination, the ParameterServer, the stages."""
