# An idmapped bind mount of the share (FUSE_ALLOW_IDMAP, Linux >= 6.12): the
# host made /mnt/idmap owned by 2000:2000; mounted on /idm with 2000 mapped
# to 0, root creates a file and a directory there, which the host must see
# owned by 2000:2000. e2e.idmapid=ID overrides 2000.
mkdir -p /idm
step idmap fsops idmap /mnt/idmap /idm "${E2E_IDMAPID:-2000}"
step idmap-ls ls -ln /mnt/idmap /idm
step idmap-read cat /idm/idmap-file
step idmap-umount umount /idm
