# One copy_file_range of more than 4 GiB from a sparse file on the share
# (an ext4 image on the host): the host made /mnt/sparse (e2e.copylen
# bytes, data at its start, middle and end); the guest copies it whole in
# one call and prints the count the call returned (COPY_FILE_RANGE_64 on
# Linux >= 7.0; older guests clamp to COPY_FILE_RANGE's 32 bits).
step copy64 fsops copyonce /mnt/sparse /mnt/copy "${E2E_COPYLEN:-5368709120}"
# (The host compares the two files and the copy's allocation: reading
# 5 GiB through TCG would take minutes.)
