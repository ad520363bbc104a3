package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
)

// countFDs is the number of descriptors the processes hold, summed (a
// sandboxed daemon's supervisor holds a few, its child the inodes').
func countFDs(pids []int) int {
	n := 0
	for _, pid := range pids {
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		if err == nil {
			n += len(ents)
		}
	}
	return n
}

// nofileLimit is the soft RLIMIT_NOFILE of the process holding the most
// descriptors: the one serving.
func nofileLimit(pids []int) uint64 {
	best, most := 0, -1
	for _, pid := range pids {
		if n := countFDs([]int{pid}); n > most {
			best, most = pid, n
		}
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", best))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Max open files"); ok {
			if f := strings.Fields(rest); len(f) > 0 {
				v, _ := strconv.ParseUint(f[0], 10, 64)
				return v
			}
		}
	}
	return 0
}

// ownMemory is, in KiB, the processes' RssAnon plus the resident part of
// shared memory they made themselves (memfds other than the front end's
// guest RAM and dirty log, /dev/shm files, SysV segments): what the daemon
// allocates, not the guest memory it maps.
func ownMemory(pids []int) int {
	kib := ProcessMemory(pids).RssAnon
	for _, pid := range pids {
		kib += ownShmem(pid)
	}
	return kib
}

// ownShmem sums the Rss of pid's mappings of its own shared memory, from
// /proc/PID/smaps.
func ownShmem(pid int) int {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	kib, own := 0, false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Bytes()
		fields := bytes.Fields(line)
		if len(fields) == 0 {
			continue
		}
		if !bytes.HasSuffix(fields[0], []byte(":")) { // a mapping's header
			own = false
			if len(fields) >= 6 {
				path := string(bytes.Join(fields[5:], []byte(" ")))
				own = strings.HasPrefix(path, "/memfd:") && !strings.HasPrefix(path, "/memfd:vmm-") ||
					strings.HasPrefix(path, "/dev/shm/") || strings.HasPrefix(path, "/SYSV")
			}
			continue
		}
		if own && string(fields[0]) == "Rss:" && len(fields) > 1 {
			n, _ := strconv.Atoi(string(fields[1]))
			kib += n
		}
	}
	return kib
}

// slabKiB is the host's Slab from /proc/meminfo.
func slabKiB() int {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	n := 0
	procFields(b, func(k string, v int64) {
		if k == "Slab" {
			n = int(v)
		}
	})
	return n
}

// printScale prints one share's table: per configuration, the median over
// its successful rounds of each figure (µs CPU: the daemon's CPU time per
// LOOKUP) (the time is the worst round's
// LOOKUPs at the median rate), and the inodes found and errors of its
// worst round. A directory whose LOOKUP failed is not walked: its
// files count as not found, not as errors.
func printScale(out io.Writer, share *scaleShare, configs []ScaleConfig, runs []ScaleRun, opens int) {
	fmt.Fprintf(out, "\nscale: %s, %d inodes (%d files in %d directories), LOOKUP of each kept, then OPEN of %d files; medians of %d run(s) per daemon\n",
		share.FS, share.inodes(), share.Files, share.Dirs, opens, len(runs)/max(len(configs), 1))
	fmt.Fprintf(out, "%-12s %7s %8s %8s %8s %8s %9s %9s %10s %8s %8s  %-28s %s\n",
		"daemon", "nofile", "found", "fds:mnt", "lookups", "+opens", "B/inode", "slab B/i", "lookups/s", "µs CPU", "time", "LOOKUP errors", "OPEN errors")
	for _, c := range configs {
		var ok []ScaleRun
		var failed []string
		for _, r := range runs {
			if r.Config != c.Name {
				continue
			}
			if r.Err != nil {
				failed = append(failed, r.Err.Error())
				continue
			}
			ok = append(ok, r)
		}
		if len(ok) == 0 {
			fmt.Fprintf(out, "%-12s failed: %s\n", c.Name, strings.Join(failed, "; "))
			continue
		}
		med := func(f func(r *ScaleRun) float64) float64 {
			v := make([]float64, len(ok))
			for i := range ok {
				v[i] = f(&ok[i])
			}
			sort.Float64s(v)
			return v[len(v)/2]
		}
		worst := &ok[0]
		for i := range ok {
			if ok[i].Found < worst.Found {
				worst = &ok[i]
			}
		}
		fmt.Fprintf(out, "%-12s %7d %8d %8.0f %8.0f %8.0f %9.0f %9.0f %10.0f %8.1f %7.2fs  %-28s %s\n", c.Name, worst.Nofile, worst.Found,
			med(func(r *ScaleRun) float64 { return float64(r.FDs[0]) }),
			med(func(r *ScaleRun) float64 { return float64(r.FDs[1]) }),
			med(func(r *ScaleRun) float64 { return float64(r.FDs[2]) }),
			med((*ScaleRun).BytesPerInode), med((*ScaleRun).SlabPerInode), med((*ScaleRun).LookupRate), med((*ScaleRun).LookupCost),
			float64(worst.Lookups)/med((*ScaleRun).LookupRate),
			fmtErrnos(worst.LookupErrors), fmtErrnos(worst.OpenErrors))
		if len(failed) > 0 {
			fmt.Fprintf(out, "%-12s %d round(s) failed: %s\n", "", len(failed), strings.Join(failed, "; "))
		}
	}
}
