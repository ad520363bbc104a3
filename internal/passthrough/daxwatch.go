package passthrough

import (
	"encoding/binary"
	"errors"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// Host writes under read tails. A tail is a copy (dax.go), so a host
// process writing the last partial page of a mapped file, or any page of a
// file mapped as a private copy (--readonly, an executable), would leave
// the guest reading the old bytes until the slot is mapped again. The
// daemon watches the file of every read tail with inotify (IN_MODIFY:
// write, truncate, fallocate, copy_file_range, by any process) and copies
// the file into the tail again when one arrives, so the guest's mapping
// shows such a write shortly after it is made. Not covered: a writable
// tail (the guest's stores there are the newer bytes; a host write is
// overwritten at the next write-back), and a store through a host mmap,
// which raises no event. A daemon that cannot watch (inotify refused, out
// of watches) logs it once and serves on without this.
//
// One inotify instance per FS, made with the window; a goroutine reads it
// through the netpoller. inotify keeps one watch per host inode however
// often it is added: byWD lists the tails behind each, and the watch goes
// when the last of them does.
type tailWatch struct {
	f      *FS
	file   *os.File // the inotify instance, non-blocking: Close wakes the reader
	done   chan struct{}
	warned atomic.Bool // add's failure was logged

	mu   sync.Mutex
	byWD map[int32][]watchedTail
	byTL map[*tail]int32
}

type watchedTail struct {
	ino *inode
	tl  *tail
}

// watchMask: the events that change a file's bytes.
const watchMask = unix.IN_MODIFY

// startTailWatch makes f's watch (nil when inotify is refused: logged).
func (f *FS) startTailWatch() *tailWatch {
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		f.log.Warn("passthrough: DAX: no inotify; host writes to a mapped file's last partial page reach the guest only when it maps the slot again", "err", err)
		return nil
	}
	w := &tailWatch{f: f, file: os.NewFile(uintptr(fd), "inotify"), done: make(chan struct{}),
		byWD: map[int32][]watchedTail{}, byTL: map[*tail]int32{}}
	go w.run()
	return w
}

// stop closes the instance and waits for the reader.
func (w *tailWatch) stop() {
	if w == nil {
		return
	}
	w.file.Close()
	<-w.done
}

// add watches tl's file (a read tail of i). The caller holds i's tails.mu.
func (w *tailWatch) add(i *inode, tl *tail) {
	if w == nil {
		return
	}
	wd, err := w.addWatch(tl.fd)
	if err != nil {
		if w.warned.CompareAndSwap(false, true) {
			w.f.log.Warn("passthrough: DAX: cannot watch a mapped file; host writes to its last partial page reach the guest only when it maps the slot again", "node", i.id, "err", err)
		}
		return
	}
	w.mu.Lock()
	w.byWD[wd] = append(w.byWD[wd], watchedTail{ino: i, tl: tl})
	w.byTL[tl] = wd
	w.mu.Unlock()
}

// addWatch adds a watch of the file open as fd, named through
// /proc/self/fd: inotify_add_watch takes only a path. In the sandbox that
// is the credential worker's cwd.
func (w *tailWatch) addWatch(fd int) (int32, error) {
	var wd int
	var err error
	name := strconv.Itoa(fd)
	errno := w.f.onWorker(func() syscall.Errno {
		wd, err = unix.InotifyAddWatch(int(w.file.Fd()), name, watchMask)
		return 0
	})
	if errno != 0 { // no worker with its own cwd: the process's /proc
		wd, err = unix.InotifyAddWatch(int(w.file.Fd()), "/proc/self/fd/"+name, watchMask)
	}
	return int32(wd), err
}

// remove forgets tl, and the watch with the last tail behind it. It does
// not take tails.mu (dropTail calls it).
func (w *tailWatch) remove(tl *tail) {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	wd, ok := w.byTL[tl]
	if !ok {
		return
	}
	delete(w.byTL, tl)
	list := slices.DeleteFunc(w.byWD[wd], func(x watchedTail) bool { return x.tl == tl })
	if len(list) > 0 {
		w.byWD[wd] = list
		return
	}
	delete(w.byWD, wd)
	unix.InotifyRmWatch(int(w.file.Fd()), uint32(wd))
}

// run reads events until the instance is closed, refreshing the tails
// behind each watch that reports a change.
func (w *tailWatch) run() {
	defer close(w.done)
	buf := make([]byte, 64*(unix.SizeofInotifyEvent+unix.NAME_MAX+1))
	var changed []watchedTail
	for {
		n, err := w.file.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				w.f.log.Warn("passthrough: DAX: reading inotify failed; host writes to mapped tails are no longer followed", "err", err)
			}
			return
		}
		changed = changed[:0]
		w.mu.Lock()
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			wd := int32(binary.NativeEndian.Uint32(buf[off:]))
			mask := binary.NativeEndian.Uint32(buf[off+4:])
			l := int(binary.NativeEndian.Uint32(buf[off+12:]))
			off += unix.SizeofInotifyEvent + l
			switch {
			case mask&unix.IN_Q_OVERFLOW != 0: // events lost: every tail
				changed = changed[:0]
				for _, list := range w.byWD {
					changed = append(changed, list...)
				}
				off = n
			case mask&watchMask != 0:
				for _, x := range w.byWD[wd] {
					if !slices.Contains(changed, x) {
						changed = append(changed, x)
					}
				}
			}
		}
		w.mu.Unlock()
		for _, x := range changed {
			x.ino.refreshTail(x.tl)
		}
	}
}

// refreshTail copies the file into tl again, if tl is still one of i's
// tails: under tails.mu it cannot be dropped (dropTail detaches it under
// that lock before unmapping it).
func (i *inode) refreshTail(tl *tail) {
	nt := i.tails.Load()
	if nt == nil {
		return
	}
	nt.mu.Lock()
	defer nt.mu.Unlock()
	if !slices.Contains(nt.tails, tl) {
		return
	}
	if errno := tl.refresh(tl.start, uint64(len(tl.mem))); errno != 0 {
		i.fs.log.Warn("passthrough: DAX: refreshing a mapped tail after a host write failed", "node", i.id, "offset", tl.start, "err", errno)
	}
}
