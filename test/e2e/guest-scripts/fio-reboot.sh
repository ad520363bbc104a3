# Access the share, run a small fio write + crc32c verify, then ask the host:
#   "reboot" -> reboot -f (the same kernel command line runs this script again)
#   anything else / timeout -> power off.
# e2e.fiosize=SIZE sets fio's file size (fio-smoke.sh; default 8M).
. /e2e/scripts/access.sh
. /e2e/scripts/fio-smoke.sh
ans=$(e2e_ask next)
case $ans in
reboot) e2e_final reboot ;;
*) e2e_final poweroff ;;
esac
