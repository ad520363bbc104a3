package integration

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// mount745 sends FUSE_INIT as Linux 7.2 does (7.45, its flags) and checks
// the answer: 7.45 with ALLOW_IDMAP, none of the flags refused on purpose,
// no request timeout.
func (c *fsc) mount745() *vmm.InitOut {
	c.t.Helper()
	o, err := c.Init(vmm.Linux72Minor, vmm.Linux72InitFlags|vmm.InitPassthrough|vmm.InitOverIOURing)
	if err != nil {
		c.t.Fatalf("FUSE_INIT: %v", err)
	}
	if o.Minor != 45 || o.Flags&vmm.InitAllowIdmap == 0 || o.RequestTimeout != 0 ||
		o.Flags&(vmm.InitPassthrough|vmm.InitNoExportSupport|vmm.InitHasResend|vmm.InitOverIOURing|vmm.InitRequestTimeout) != 0 {
		c.t.Fatalf("FUSE_INIT answered 7.%d flags %#x timeout %d", o.Minor, o.Flags, o.RequestTimeout)
	}
	return o
}

// TestFuse745Init: a 7.2 guest gets 7.45 and ALLOW_IDMAP; a 6.12 guest
// 7.41 and ALLOW_IDMAP; a 6.1 guest 7.38 and no flag it did not get before.
func TestFuse745Init(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	c.mount745()
	o, err := c.Init(41, vmm.LinuxInitFlags|vmm.InitCreateSuppGroup|vmm.InitAllowIdmap|vmm.InitHasResend|vmm.InitNoExportSupport)
	if err != nil || o.Minor != 41 || o.Flags&vmm.InitAllowIdmap == 0 || o.Flags&(vmm.InitHasResend|vmm.InitNoExportSupport) != 0 {
		t.Fatalf("6.12's INIT: %+v %v", o, err)
	}
	o = c.mount()
	if o.Flags>>32&^(vmm.InitCreateSuppGroup|vmm.InitHasExpireOnly|vmm.InitDirectIOAllowMmap)>>32 != 0 {
		t.Fatalf("6.1's INIT got flags2 %#x", o.Flags>>32)
	}
}

// TestAllowIdmap: with ALLOW_IDMAP, requests that create nothing carry
// uid and gid 0xffffffff and are served; a creation with them is refused
// (EOVERFLOW), a creation with real ids makes an object the host sees
// owned by them, translated by --translate-uid/gid when given.
func TestAllowIdmap(t *testing.T) {
	for _, tc := range []struct {
		name     string
		args     []string
		uid, gid uint32 // the host owner of what 1000:1000 creates
	}{
		{"plain", nil, 1000, 1000},
		{"translate", []string{"--translate-uid", "map:1000:2000:1", "--translate-gid", "map:1000:3000:1"}, 2000, 3000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t, tc.args...)
			dev := d.connect(opts())
			c := newFS(t, dev, 1)
			c.mount745()
			d.writeHostFile("f", []byte("hello"))
			if err := os.Chown(filepath.Join(d.dir, "f"), 4000, 4000); err != nil {
				t.Fatal(err)
			}
			os.Chmod(filepath.Join(d.dir, "f"), 0o600)

			c.UID, c.GID = vmm.InvalidUIDGID, vmm.InvalidUIDGID
			e := c.lookup(vmm.RootID, "f")
			c.getattr(e.NodeID)
			fh := c.open(e.NodeID, syscall.O_RDWR)
			c.write(e.NodeID, fh, 5, []byte(" world"))
			if got := string(c.read(e.NodeID, fh, 0, 64)); got != "hello world" {
				t.Fatalf("read %q", got)
			}
			// ACCESS: the guest checked it (default_permissions).
			if _, err := c.Call(vmm.OpAccess, e.NodeID, le32(le32(nil, 6), 0), nil, 0); err != nil {
				t.Fatalf("ACCESS: %v", err)
			}
			// A creation with no ids is refused.
			_, err := c.Call(vmm.OpMkdir, vmm.RootID, append(le32(le32(nil, 0o755), 0o022), "nobody\x00"...), nil, vmm.FuseEntryOutSize)
			if !errors.Is(err, syscall.EOVERFLOW) {
				t.Fatalf("MKDIR as 0xffffffff: %v, want EOVERFLOW", err)
			}
			if _, err := os.Lstat(filepath.Join(d.dir, "nobody")); err == nil {
				t.Fatal("created")
			}
			// Renames, unlinks with no ids.
			if _, err := c.Call(vmm.OpRename, vmm.RootID, append(le64(nil, vmm.RootID), "f\x00g\x00"...), nil, 0); err != nil {
				t.Fatalf("RENAME: %v", err)
			}
			// A creation (through an idmapped mount) with real ids.
			if err := os.Mkdir(filepath.Join(d.dir, "pub"), 0o777); err != nil {
				t.Fatal(err)
			}
			os.Chmod(filepath.Join(d.dir, "pub"), 0o777)
			pub := c.lookup(vmm.RootID, "pub").NodeID
			c.UID, c.GID = 1000, 1000
			if _, _, err := c.tryCreate(pub, "mine", syscall.O_RDWR); err != nil {
				t.Fatalf("CREATE as 1000: %v", err)
			}
			var st syscall.Stat_t
			if err := syscall.Lstat(filepath.Join(d.dir, "pub/mine"), &st); err != nil || st.Uid != tc.uid || st.Gid != tc.gid {
				t.Fatalf("host owner %d:%d (%v), want %d:%d", st.Uid, st.Gid, err, tc.uid, tc.gid)
			}
			c.UID, c.GID = vmm.InvalidUIDGID, vmm.InvalidUIDGID
			if _, err := c.Call(vmm.OpUnlink, pub, []byte("mine\x00"), nil, 0); err != nil {
				t.Fatalf("UNLINK: %v", err)
			}
			d.alive()
		})
	}
}

// TestSupplementaryGroups: a creation carrying several groups
// (FUSE_EXT_GROUPS) succeeds where any one of them may write, fails where
// none may.
func TestSupplementaryGroups(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	c.mount745()
	for _, g := range []struct {
		name string
		gid  int
	}{{"g1", 4241}, {"g2", 4242}, {"g3", 4243}} {
		p := filepath.Join(d.dir, g.name)
		if err := os.Mkdir(p, 0o770); err != nil {
			t.Fatal(err)
		}
		os.Chown(p, 0, g.gid)
		os.Chmod(p, 0o770)
	}
	c.UID, c.GID = 1000, 1000
	mkdir := func(dir, name string, groups ...uint32) error {
		var ext []byte
		if len(groups) > 0 {
			ext = vmm.ExtGroups(groups...)
		}
		_, err := c.CallExt(vmm.OpMkdir, c.lookup(vmm.RootID, dir).NodeID,
			append(le32(le32(nil, 0o755), 0o022), name+"\x00"...), ext, nil, vmm.FuseEntryOutSize)
		return err
	}
	for _, tc := range []struct {
		dir    string
		groups []uint32
		want   error
	}{
		{"g1", []uint32{4241, 4242}, nil},
		{"g2", []uint32{4241, 4242}, nil},
		{"g3", []uint32{4241, 4242}, syscall.EACCES},
		{"g3", nil, syscall.EACCES},
		{"g3", []uint32{4243}, nil},
	} {
		err := mkdir(tc.dir, "d", tc.groups...)
		if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("MKDIR in %s with %v: %v, want %v", tc.dir, tc.groups, err, tc.want)
		}
	}
	many := make([]uint32, 33)
	for i := range many {
		many[i] = 4242
	}
	if err := mkdir("g2", "e", many...); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("33 groups: %v, want EINVAL", err)
	}
	d.alive()
}

// ext4Share makes an ext4 file system in a loop-mounted sparse image, the
// share of a daemon: the host copies holes of a sparse file there through
// splice, as zeros, unless the daemon keeps them.
func ext4Share(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount")
	}
	tmp := t.TempDir()
	img, mnt := filepath.Join(tmp, "ext4.img"), filepath.Join(tmp, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-b", "4096", img, "256M").CombinedOutput(); err != nil {
		t.Skipf("mkfs.ext4: %v %s", err, out)
	}
	if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		t.Skipf("loop mount: %v %s", err, out)
	}
	t.Cleanup(func() { syscall.Unmount(mnt, syscall.MNT_DETACH) })
	share := filepath.Join(mnt, "share")
	if err := os.Mkdir(share, 0o755); err != nil {
		t.Fatal(err)
	}
	return share
}

// TestCopyFileRange64: one COPY_FILE_RANGE_64 copies a sparse 6 GiB file
// on an ext4 share (256 MiB) whole, and the copy stays sparse;
// COPY_FILE_RANGE copies at most 0xfffff000 bytes.
func TestCopyFileRange64(t *testing.T) {
	share := ext4Share(t)
	d := startDaemonWith(t, daemonSpec{share: share})
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	c.mount745()
	const size = 6 << 30
	f, err := os.Create(filepath.Join(share, "src"))
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte("head"), 0)
	f.WriteAt([]byte("middle"), 3<<30)
	f.WriteAt([]byte("tail"), size-4)
	f.Close()
	src := c.lookup(vmm.RootID, "src")
	sfh := c.open(src.NodeID, syscall.O_RDONLY)
	dnode, dfh := c.create(vmm.RootID, "dst", syscall.O_RDWR)
	copyIn := func(n uint64) []byte {
		b := le64(le64(le64(le64(le64(nil, sfh), 0), dnode), dfh), 0)
		return le64(le64(b, n), 0)
	}
	body, err := c.Call(vmm.OpCopyFileRange64, src.NodeID, copyIn(size+(1<<30)), nil, 8)
	if err != nil || len(body) != 8 || le.Uint64(body) != size {
		t.Fatalf("COPY_FILE_RANGE_64: % x %v, want %d bytes copied", body, err, uint64(size))
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(share, "dst"), &st); err != nil || st.Size != size || st.Blocks*512 > 1<<20 {
		t.Fatalf("copy: size %d, %d bytes allocated (%v)", st.Size, st.Blocks*512, err)
	}
	g, _ := os.Open(filepath.Join(share, "dst"))
	for _, x := range []struct {
		off  int64
		want string
	}{{0, "head"}, {3 << 30, "middle"}, {size - 4, "tail"}, {1 << 30, "\x00\x00\x00\x00"}} {
		b := make([]byte, len(x.want))
		if _, err := g.ReadAt(b, x.off); err != nil || string(b) != x.want {
			t.Errorf("at %d: %q %v, want %q", x.off, b, err, x.want)
		}
	}
	g.Close()
	body, err = c.Call(vmm.OpCopyFileRange, src.NodeID, copyIn(size), nil, 8)
	if err != nil || len(body) != 8 || le.Uint32(body) != 0xfffff000 {
		t.Fatalf("COPY_FILE_RANGE: % x %v, want 0xfffff000 bytes copied", body, err)
	}
	d.alive()
}
