package bench

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// The scale run's shares: N empty files in directories of scaleDirFiles
// each (d0000/f000000 ...), as the measurements laid them out, so
// that 15,000 files make 15,015 inodes.
const scaleDirFiles = 1000

// ScaleFS are the file systems the scale run knows: tmpfs; ext4 on a loop
// image (default options); overlayfs without nfs_export (how container
// runtimes mount a container's root: name_to_handle_at answers
// EOPNOTSUPP there), its lower, upper and work directories on a tmpfs and
// the files in the lower layer, as an image's are; "dir" is a directory of
// the scratch file system, for a run without root.
var ScaleFS = []string{"tmpfs", "ext4", "overlay"}

// scaleShare is a prepared share and how to take it down.
type scaleShare struct {
	FS    string
	Path  string
	Files int // regular files
	Dirs  int // directories below the root
	undo  []func()
}

// inodes is what a walk looks up: the directories and the files.
func (s *scaleShare) inodes() int { return s.Files + s.Dirs }

func (s *scaleShare) close() {
	for i := len(s.undo) - 1; i >= 0; i-- {
		s.undo[i]()
	}
	s.undo = nil
}

func scaleDirName(d int) string  { return fmt.Sprintf("d%04d", d) }
func scaleFileName(f int) string { return fmt.Sprintf("f%07d", f) }

// prepareScaleShare mounts fsType under dir and creates files empty files.
func prepareScaleShare(fsType, dir string, files int) (_ *scaleShare, err error) {
	s := &scaleShare{FS: fsType, Files: files, Dirs: (files + scaleDirFiles - 1) / scaleDirFiles}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	base := filepath.Join(dir, "scale-"+fsType)
	if err := os.MkdirAll(base, 0o755); err != nil {
		return nil, err
	}
	s.undo = append(s.undo, func() { os.RemoveAll(base) })
	mountTmpfs := func(at string) error {
		if err := os.MkdirAll(at, 0o755); err != nil {
			return err
		}
		if err := unix.Mount("tmpfs", at, "tmpfs", 0, "mode=0755,nr_inodes=0"); err != nil {
			return fmt.Errorf("mount tmpfs on %s: %w", at, err)
		}
		s.undo = append(s.undo, func() { unix.Unmount(at, unix.MNT_DETACH) })
		return nil
	}
	populate := base
	switch fsType {
	case "dir":
		s.Path = filepath.Join(base, "share")
		populate = s.Path
		if err := os.Mkdir(s.Path, 0o755); err != nil {
			return nil, err
		}
	case "tmpfs":
		s.Path = filepath.Join(base, "share")
		populate = s.Path
		if err := mountTmpfs(s.Path); err != nil {
			return nil, err
		}
	case "ext4":
		img := filepath.Join(base, "ext4.img")
		size := max(256<<20, int64(files)*1024)
		f, err := os.Create(img)
		if err == nil {
			err = f.Truncate(size)
			f.Close()
		}
		if err != nil {
			return nil, err
		}
		// One inode per file and directory and some to spare; 256-byte
		// inodes, as mke2fs's default.
		if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-N", fmt.Sprint(files+files/8+1024), img).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("mkfs.ext4: %v: %s", err, out)
		}
		s.Path = filepath.Join(base, "share")
		populate = s.Path
		if err := os.Mkdir(s.Path, 0o755); err != nil {
			return nil, err
		}
		// mount -o loop sets up the loop device with autoclear: the
		// unmount frees it.
		if out, err := exec.Command("mount", "-t", "ext4", "-o", "loop", img, s.Path).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("mount ext4 image: %v: %s", err, out)
		}
		s.undo = append(s.undo, func() { unix.Unmount(s.Path, 0) })
	case "overlay":
		layers := filepath.Join(base, "layers")
		if err := mountTmpfs(layers); err != nil {
			return nil, err
		}
		populate = filepath.Join(layers, "lower")
		for _, d := range []string{"lower", "upper", "work"} {
			if err := os.Mkdir(filepath.Join(layers, d), 0o755); err != nil {
				return nil, err
			}
		}
		if err := createScaleFiles(populate, files); err != nil {
			return nil, err
		}
		s.Path = filepath.Join(base, "share")
		if err := os.Mkdir(s.Path, 0o755); err != nil {
			return nil, err
		}
		opts := fmt.Sprintf("lowerdir=%s/lower,upperdir=%s/upper,workdir=%s/work,nfs_export=off,index=off", layers, layers, layers)
		if err := unix.Mount("overlay", s.Path, "overlay", 0, opts); err != nil {
			return nil, fmt.Errorf("mount overlay: %w", err)
		}
		s.undo = append(s.undo, func() { unix.Unmount(s.Path, unix.MNT_DETACH) })
		return s, nil
	default:
		return nil, fmt.Errorf("scale: unknown file system %q (want one of %s, dir)", fsType, strings.Join(ScaleFS, ", "))
	}
	if err := createScaleFiles(populate, files); err != nil {
		return nil, err
	}
	return s, nil
}

// createScaleFiles makes the directories and the empty files, one mknodat
// per file.
func createScaleFiles(root string, files int) error {
	for d := 0; d*scaleDirFiles < files; d++ {
		p := filepath.Join(root, scaleDirName(d))
		if err := os.Mkdir(p, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
		dfd, err := unix.Open(p, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		for f := d * scaleDirFiles; f < min(files, (d+1)*scaleDirFiles); f++ {
			if err := unix.Mknodat(dfd, scaleFileName(f), unix.S_IFREG|0o644, 0); err != nil && err != unix.EEXIST {
				unix.Close(dfd)
				return fmt.Errorf("mknod %s/%s: %w", p, scaleFileName(f), err)
			}
		}
		unix.Close(dfd)
	}
	return nil
}
