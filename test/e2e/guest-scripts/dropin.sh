# A short workload for each drop-in launch line (TestDropInLaunchLines):
# list and read what the host put there, create, write, rename, read back,
# remove, and a small fio write+verify. /mnt/kept stays for the host to
# check. Sourced by /init in a subshell (step comes from there).
step ls ls -la /mnt
step cat cat /mnt/hello
step write sh -c 'mkdir /mnt/d && echo "written by the guest" >/mnt/d/f && mv /mnt/d/f /mnt/d/g && echo kept >/mnt/kept'
step read cat /mnt/d/g
step rm sh -c 'rm /mnt/d/g && rmdir /mnt/d && ! test -e /mnt/d'
step fio fio --name=dropin --directory=/mnt --size=4M --bs=64k --rw=write --ioengine=psync \
	--verify=crc32c --do_verify=1 --verify_fatal=1 --end_fsync=1
step fio-rm rm -f /mnt/dropin.0.0
