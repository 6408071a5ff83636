"""The rank protocol as a library, and the coordinator-driven replay."""
