# Access the share, then ask the host what to do next:
#   "reboot" -> reboot -f (the same kernel command line runs this script again)
#   anything else / timeout -> power off; the host may also end QEMU while we wait.
. /e2e/scripts/access.sh
ans=$(e2e_ask next)
case $ans in
reboot) e2e_final reboot ;;
wait) e2e_final wait ;;
*) e2e_final poweroff ;;
esac
