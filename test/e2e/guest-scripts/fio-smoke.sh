# A small fio write+verify job on the share (exercises WRITE/READ with many pages).
# e2e.fiosize=SIZE overrides the file size (default 8M).
step fio fio --name=smoke --directory=/mnt --size="${E2E_FIOSIZE:-8M}" --bs=1M --rw=write \
	--direct=1 --verify=crc32c --do_verify=1 --ioengine=psync --numjobs=1
step fio-rm rm -f /mnt/smoke.0.0
