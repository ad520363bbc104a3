//go:build linux

package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestIdmapMount: a Linux >= 6.12 guest negotiates FUSE_ALLOW_IDMAP and
// makes an idmapped bind mount of a directory of the share (idmap.sh,
// fsops idmap: a user namespace mapping 2000 to 0, open_tree,
// mount_setattr(MOUNT_ATTR_IDMAP), move_mount); root creates a file and a
// directory through it, and the host sees them owned by 2000:2000. Without
// ALLOW_IDMAP negotiated, mount_setattr fails (EINVAL).
//
// Subtests: 6.12 on QEMU 10 (FUSE 7.41), 7.x on QEMU 11 (7.45).
func TestIdmapMount(t *testing.T) {
	requireE2E(t)
	t.Run("6.12", func(t *testing.T) {
		peersBin(t, qemu10Wrapper)
		runIdmapMount(t, newestKernelAtLeast(t, 6, 12, "idmapped virtio-fs mounts need Linux 6.12"), qemu10)
	})
	t.Run("7.x", func(t *testing.T) {
		peersBin(t, qemu11Wrapper)
		runIdmapMount(t, newestKernel7(t), qemu11)
	})
}

func runIdmapMount(t *testing.T, k guestKernel, q qemuVersion) {
	e := newEnv(t, ourDaemon, k)
	dir := filepath.Join(e.shared, "idmap")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(dir, 2000, 2000); err != nil {
		t.Fatal(err)
	}
	v := e.start(vmConfig{QEMU: q, Script: "idmap", Timeout: 3 * time.Minute})
	v.waitExit()
	e.daemonExit(v, true)
	g := parseConsole(v.consoleLines())
	st := g.step(t, 1, "idmap")
	t.Logf("%s: fsops idmap: rc=%d %q", k.Version, st.RC, st.Output)
	if st.RC != 0 || len(st.Output) == 0 || !strings.HasPrefix(st.Output[len(st.Output)-1], "ok mnt=0:0 src=2000:2000") {
		t.Fatalf("idmapped mount in the guest: rc=%d %v", st.RC, st.Output)
	}
	for _, name := range []string{"idmap-file", "idmap-dir"} {
		var s syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(dir, name), &s); err != nil || s.Uid != 2000 || s.Gid != 2000 {
			t.Errorf("host: %s owned by %d:%d (%v), want 2000:2000", name, s.Uid, s.Gid, err)
		}
	}
	if st := g.step(t, 1, "idmap-read"); st.RC != 0 {
		t.Errorf("read through the idmapped mount: rc=%d %v", st.RC, st.Output)
	}
	want := "negotiated=7.41"
	if kernelAtLeast(k.Version, 7, 0) {
		want = "negotiated=7.45"
	}
	if !strings.Contains(e.d.Log(), want) {
		t.Errorf("the %s session was not %s", k.Version, want)
	}
}

// TestCopyFileRange64Guest: on a Linux 7.x guest (FUSE 7.45) under QEMU 11 one
// copy_file_range of a sparse 5 GiB file on an ext4 share copies it whole
// (COPY_FILE_RANGE_64), and the copy stays sparse on the host.
func TestCopyFileRange64Guest(t *testing.T) {
	requireE2E(t)
	peersBin(t, qemu11Wrapper)
	k := newestKernel7(t) // COPY_FILE_RANGE_64 is Linux 7.x's (FUSE 7.45)
	tmp := t.TempDir()
	img, share := filepath.Join(tmp, "ext4.img"), filepath.Join(tmp, "share")
	if err := os.Mkdir(share, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-b", "4096", img, "512M").CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v %s", err, out)
	}
	if out, err := exec.Command("mount", "-o", "loop", img, share).CombinedOutput(); err != nil {
		t.Fatalf("loop mount: %v %s", err, out)
	}
	t.Cleanup(func() { syscall.Unmount(share, syscall.MNT_DETACH) })
	const size = 5 << 30
	f, err := os.Create(filepath.Join(share, "sparse"))
	if err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, size / 2, size - 4096} {
		if _, err := f.WriteAt([]byte(strings.Repeat("x", 4096)), off); err != nil {
			t.Fatal(err)
		}
	}
	f.Close()
	e := newEnvAt(t, ourDaemon, k, share)
	v := e.start(vmConfig{QEMU: qemu11, Script: "copy64", Timeout: 4 * time.Minute})
	v.waitExit()
	e.daemonExit(v, true)
	g := parseConsole(v.consoleLines())
	st := g.step(t, 1, "copy64")
	t.Logf("%s: one copy_file_range of %d bytes returned %v", k.Version, int64(size), st.Output)
	if st.RC != 0 || len(st.Output) == 0 || st.Output[len(st.Output)-1] != "5368709120" {
		t.Fatalf("guest copy: rc=%d %v", st.RC, st.Output)
	}
	var s syscall.Stat_t
	if err := syscall.Stat(filepath.Join(share, "copy"), &s); err != nil || s.Size != size || s.Blocks*512 > 4<<20 {
		t.Fatalf("host copy: size %d, %d bytes allocated (%v)", s.Size, s.Blocks*512, err)
	}
	ops := map[string]int{}
	for _, r := range e.d.fuseRequests(t) {
		ops[r.Opcode]++
	}
	t.Logf("copy requests: COPY_FILE_RANGE_64 %d, COPY_FILE_RANGE %d", ops["COPY_FILE_RANGE_64"], ops["COPY_FILE_RANGE"])
	if ops["COPY_FILE_RANGE_64"] != 1 {
		t.Errorf("%d COPY_FILE_RANGE_64 requests, want 1", ops["COPY_FILE_RANGE_64"])
	}
}
