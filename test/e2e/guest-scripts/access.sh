# First access to the share: list it and read the file the host put there.
# Sourced by /init in a subshell (step, e2e_ask, e2e_final are defined there).
step ls ls -la /mnt
step cat cat /mnt/hello
