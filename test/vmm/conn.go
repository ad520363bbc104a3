package vmm

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Header is the vhost-user message header, in host (little) endian.
type Header struct {
	Request Request
	Flags   uint32
	Size    uint32
}

// Bytes encodes the header.
func (h Header) Bytes() []byte {
	b := le.AppendUint32(nil, uint32(h.Request))
	b = le.AppendUint32(b, h.Flags)
	return le.AppendUint32(b, h.Size)
}

// Message is one received vhost-user message. The receiver owns Fds and
// must close them.
type Message struct {
	Header
	Payload []byte
	Fds     []int
}

// CloseFds closes the message's fds.
func (m *Message) CloseFds() {
	for _, fd := range m.Fds {
		unix.Close(fd)
	}
	m.Fds = nil
}

// U64 returns the payload as a u64 (features, status, acks...).
func (m *Message) U64() (uint64, error) {
	if len(m.Payload) != 8 {
		return 0, fmt.Errorf("vmm: %v reply payload is %d bytes, want 8", m.Request, len(m.Payload))
	}
	return le.Uint64(m.Payload), nil
}

// AckPolicy decides which messages carry NEED_REPLY once REPLY_ACK is
// negotiated.
type AckPolicy int

const (
	// AckQEMU sets NEED_REPLY where QEMU 7.2 does: SET_MEM_TABLE,
	// ADD_MEM_REG, REM_MEM_REG, SET_BACKEND_REQ_FD and SET_STATUS.
	AckQEMU AckPolicy = iota
	// AckAll sets NEED_REPLY on every message that has no reply of its own.
	AckAll
	// AckNever never sets NEED_REPLY.
	AckNever
	// AckQEMU10 is AckQEMU plus SET_VRING_ENABLE, as QEMU >= 8.1 sends it
	// ("vhost-user: call VHOST_USER_SET_VRING_ENABLE synchronously"; seen
	// with QEMU 10.0.2): the front end kicks a ring only after the back end
	// has enabled it. A back end that drops a kick arriving before its
	// ENABLE (the Rust virtiofsd 1.13) needs it.
	AckQEMU10
)

// ReplyError is a non-zero REPLY_ACK answer.
type ReplyError struct {
	Request Request
	Code    uint64
}

func (e *ReplyError) Error() string {
	return fmt.Sprintf("vmm: back end acked %v with %d", e.Request, e.Code)
}

// ErrTimeout is returned when the peer does not answer in time.
var ErrTimeout = errors.New("vmm: timed out")

// Conn is one end of a vhost-user connection: the front end's socket to the
// back end, or the front end's side of the backend-request channel.
type Conn struct {
	fd int

	// Timeout bounds every wait for a reply (default 5 s).
	Timeout time.Duration
	// Ack selects where NEED_REPLY is set once REPLY_ACK is negotiated.
	Ack AckPolicy

	mu       sync.Mutex // one request/reply exchange at a time
	protocol uint64     // protocol features acknowledged by SET_PROTOCOL_FEATURES

	closeOnce sync.Once
	closeErr  error
}

// Dial connects to the back end's listening socket, retrying until timeout
// passes (the daemon may still be starting).
func Dial(path string, timeout time.Duration) (*Conn, error) {
	deadline := time.Now().Add(timeout)
	for {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
		if err == nil {
			return NewConn(fd), nil
		}
		unix.Close(fd)
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("vmm: connect %s: %w", path, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// NewConn wraps a connected stream socket; the Conn owns fd.
func NewConn(fd int) *Conn { return &Conn{fd: fd, Timeout: 5 * time.Second} }

// SocketPair returns a connected pair: a Conn for our side and an *os.File
// for the other side, e.g. to pass to a daemon started with --fd, or to
// send with SET_BACKEND_REQ_FD.
func SocketPair() (*Conn, *os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	return NewConn(fds[0]), os.NewFile(uintptr(fds[1]), "vhost-user-peer"), nil
}

// Fd is the socket fd.
func (c *Conn) Fd() int { return c.fd }

// Close shuts the socket down (waking any goroutine blocked reading it)
// and closes it. This is how a front end disconnects.
func (c *Conn) Close() error {
	c.closeOnce.Do(func() {
		unix.Shutdown(c.fd, unix.SHUT_RDWR)
		c.closeErr = unix.Close(c.fd)
	})
	return c.closeErr
}

// Shutdown half-closes the socket for writing (the back end then reads EOF
// while we can still read what it sends).
func (c *Conn) Shutdown() error { return unix.Shutdown(c.fd, unix.SHUT_WR) }

// ProtocolFeatures returns what the last successful SET_PROTOCOL_FEATURES
// acknowledged.
func (c *Conn) ProtocolFeatures() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.protocol
}

// SendBytes writes b as is, with fds attached to its first byte. It is the
// primitive for partial and malformed messages.
func (c *Conn) SendBytes(b []byte, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	for len(b) > 0 || oob != nil {
		n, err := unix.SendmsgN(c.fd, b, oob, nil, unix.MSG_NOSIGNAL)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("vmm: sendmsg: %w", err)
		}
		b, oob = b[n:], nil
	}
	return nil
}

// SendRaw sends a header exactly as given (Size is not recomputed), then
// payload, with fds.
func (c *Conn) SendRaw(h Header, payload []byte, fds []int) error {
	return c.SendBytes(append(h.Bytes(), payload...), fds)
}

// Send sends one well-formed message: version flag plus extra flags, size
// computed from payload.
func (c *Conn) Send(req Request, flags uint32, payload []byte, fds []int) error {
	return c.SendRaw(Header{req, FlagVersion | flags, uint32(len(payload))}, payload, fds)
}

// Recv reads one message, waiting at most c.Timeout. It returns io.EOF when
// the peer has closed the connection cleanly between messages.
func (c *Conn) Recv() (*Message, error) {
	return c.RecvTimeout(c.Timeout)
}

// RecvTimeout is Recv with an explicit timeout (<0: wait forever).
func (c *Conn) RecvTimeout(timeout time.Duration) (*Message, error) {
	var deadline time.Time
	if timeout >= 0 {
		deadline = time.Now().Add(timeout)
	}
	m := &Message{}
	hdr := make([]byte, HeaderSize)
	if err := c.readFull(hdr, deadline, m); err != nil {
		m.CloseFds()
		return nil, err
	}
	m.Header = Header{Request(le.Uint32(hdr)), le.Uint32(hdr[4:]), le.Uint32(hdr[8:])}
	if m.Size > 1<<20 {
		m.CloseFds()
		return nil, fmt.Errorf("vmm: %v message announces %d bytes", m.Request, m.Size)
	}
	m.Payload = make([]byte, m.Size)
	if err := c.readFull(m.Payload, deadline, m); err != nil {
		m.CloseFds()
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return m, nil
}

// readFull fills b from the stream, collecting any fds into m.
func (c *Conn) readFull(b []byte, deadline time.Time, m *Message) error {
	oob := make([]byte, unix.CmsgSpace(MaxFds*4))
	got := 0
	for got < len(b) {
		if err := c.waitReadable(deadline); err != nil {
			return err
		}
		n, oobn, flags, _, err := unix.Recvmsg(c.fd, b[got:], oob, unix.MSG_CMSG_CLOEXEC)
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		if err != nil {
			return fmt.Errorf("vmm: recvmsg: %w", err)
		}
		if oobn > 0 {
			cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
			if err != nil {
				return err
			}
			for _, cm := range cmsgs {
				fds, err := unix.ParseUnixRights(&cm)
				if err == nil {
					m.Fds = append(m.Fds, fds...)
				}
			}
		}
		if flags&unix.MSG_CTRUNC != 0 {
			return errors.New("vmm: received more fds than fit (MSG_CTRUNC)")
		}
		if n == 0 {
			if got == 0 {
				return io.EOF
			}
			return io.ErrUnexpectedEOF
		}
		got += n
	}
	return nil
}

func (c *Conn) waitReadable(deadline time.Time) error {
	for {
		ms := -1
		if !deadline.IsZero() {
			d := time.Until(deadline)
			if d <= 0 {
				return ErrTimeout
			}
			ms = int((d + time.Millisecond - 1) / time.Millisecond)
		}
		p := []unix.PollFd{{Fd: int32(c.fd), Events: unix.POLLIN}}
		n, err := unix.Poll(p, ms)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n > 0 {
			return nil
		}
	}
}

// WaitClosed waits until the peer closes the connection, discarding (and
// closing the fds of) anything it still sends. It returns ErrTimeout if
// the connection is still open after timeout.
func (c *Conn) WaitClosed(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(MaxFds*4))
	for {
		if err := c.waitReadable(deadline); err != nil {
			return err
		}
		n, oobn, _, _, err := unix.Recvmsg(c.fd, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if oobn > 0 {
			m := &Message{}
			if cmsgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
				for _, cm := range cmsgs {
					if fds, ferr := unix.ParseUnixRights(&cm); ferr == nil {
						m.Fds = append(m.Fds, fds...)
					}
				}
			}
			m.CloseFds()
		}
		if err == unix.ECONNRESET || (err == nil && n == 0) {
			return nil
		}
		if err != nil && err != unix.EINTR && err != unix.EAGAIN {
			return err
		}
	}
}

// recvReply reads the reply to req and checks its header: flags exactly
// ReplyFlags and the same request id. Unexpected fds are closed unless
// keepFds.
func (c *Conn) recvReply(req Request, keepFds bool) (*Message, error) {
	m, err := c.Recv()
	if err != nil {
		return nil, fmt.Errorf("vmm: waiting for %v reply: %w", req, err)
	}
	if m.Request != req || m.Flags != ReplyFlags {
		m.CloseFds()
		return nil, fmt.Errorf("vmm: %v reply has request %v flags %#x, want %v flags %#x",
			req, m.Request, m.Flags, req, ReplyFlags)
	}
	if !keepFds {
		m.CloseFds()
	}
	return m, nil
}

// needsAck decides NEED_REPLY for a request without a reply of its own.
func (c *Conn) needsAck(req Request) bool {
	if c.protocol&Bit(PReplyAck) == 0 || req.HasReply() {
		return false
	}
	switch c.Ack {
	case AckAll:
		return true
	case AckQEMU, AckQEMU10:
		switch req {
		case SetMemTable, AddMemReg, RemMemReg, SetBackendReqFd, SetStatus:
			return true
		case SetVringEnable:
			return c.Ack == AckQEMU10
		}
	}
	return false
}

// Call performs one exchange: it sends req and, if the request has a reply
// of its own, returns it (the caller owns its fds). For other requests it
// sets NEED_REPLY according to c.Ack and checks the u64 ack (a non-zero ack
// is a *ReplyError); then it returns nil.
func (c *Conn) Call(req Request, payload []byte, fds []int) (*Message, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ack := c.needsAck(req)
	return c.call(req, payload, fds, ack)
}

// CallFlags is Call with NEED_REPLY chosen by the caller.
func (c *Conn) CallFlags(req Request, payload []byte, fds []int, needReply bool) (*Message, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.call(req, payload, fds, needReply)
}

func (c *Conn) call(req Request, payload []byte, fds []int, needReply bool) (*Message, error) {
	var flags uint32
	if needReply {
		flags = FlagNeedReply
	}
	if err := c.Send(req, flags, payload, fds); err != nil {
		return nil, err
	}
	switch {
	case req.HasReply():
		return c.recvReply(req, true)
	case needReply:
		m, err := c.recvReply(req, false)
		if err != nil {
			return nil, err
		}
		v, err := m.U64()
		if err != nil {
			return nil, err
		}
		if v != 0 {
			return nil, &ReplyError{req, v}
		}
	}
	return nil, nil
}

func (c *Conn) getU64(req Request) (uint64, error) {
	m, err := c.Call(req, nil, nil)
	if err != nil {
		return 0, err
	}
	m.CloseFds()
	return m.U64()
}

func (c *Conn) do(req Request, payload []byte, fds ...int) error {
	_, err := c.Call(req, payload, fds)
	return err
}

// Reply answers a message received on this Conn (used on the backend
// channel, where we are the replying side).
func (c *Conn) Reply(m *Message, payload []byte) error {
	return c.SendRaw(Header{m.Request, ReplyFlags, uint32(len(payload))}, payload, nil)
}

// GetFeatures sends GET_FEATURES and returns the offered virtio features.
func (c *Conn) GetFeatures() (uint64, error) { return c.getU64(GetFeatures) }

// SetFeatures sends SET_FEATURES.
func (c *Conn) SetFeatures(f uint64) error { return c.do(SetFeatures, U64(f)) }

// SetOwner sends SET_OWNER.
func (c *Conn) SetOwner() error { return c.do(SetOwner, nil) }

// ResetOwner sends RESET_OWNER.
func (c *Conn) ResetOwner() error { return c.do(ResetOwner, nil) }

// SetMemTable sends SET_MEM_TABLE with one fd per region.
func (c *Conn) SetMemTable(regions []MemRegion, fds []int) error {
	return c.do(SetMemTable, MemTableBytes(regions), fds...)
}

// SetLogBase sends SET_LOG_BASE {u64 mmap_size, u64 mmap_offset} with the
// log fd and waits for its reply.
func (c *Conn) SetLogBase(size, offset uint64, fd int) error {
	p := le.AppendUint64(U64(size), offset)
	m, err := c.Call(SetLogBase, p, []int{fd})
	if err == nil {
		m.CloseFds()
	}
	return err
}

// SetLogFd sends SET_LOG_FD.
func (c *Conn) SetLogFd(fd int) error { return c.do(SetLogFd, nil, fd) }

// SetVringNum sends SET_VRING_NUM.
func (c *Conn) SetVringNum(index, num uint32) error {
	return c.do(SetVringNum, VringState{index, num}.Bytes())
}

// SetVringAddr sends SET_VRING_ADDR.
func (c *Conn) SetVringAddr(a VringAddr) error { return c.do(SetVringAddr, a.Bytes()) }

// SetVringBase sends SET_VRING_BASE: the next avail index to process (on a
// packed ring a PackedBase: both indices and wrap counters).
func (c *Conn) SetVringBase(index, base uint32) error {
	return c.do(SetVringBase, VringState{index, base}.Bytes())
}

// GetVringBase sends GET_VRING_BASE, which stops the ring, and returns the
// next avail index the back end would have processed (on a packed ring all
// 32 bits of a PackedBase).
func (c *Conn) GetVringBase(index uint32) (uint32, error) {
	m, err := c.Call(GetVringBase, VringState{index, 0}.Bytes(), nil)
	if err != nil {
		return 0, err
	}
	m.CloseFds()
	if len(m.Payload) != 8 {
		return 0, fmt.Errorf("vmm: GET_VRING_BASE reply payload is %d bytes, want 8", len(m.Payload))
	}
	if i := le.Uint32(m.Payload); i != index {
		return 0, fmt.Errorf("vmm: GET_VRING_BASE reply is for ring %d, want %d", i, index)
	}
	return le.Uint32(m.Payload[4:]), nil
}

func (c *Conn) vringFile(req Request, index uint32, fd int) error {
	if fd < 0 {
		return c.do(req, VringFile(index, true))
	}
	return c.do(req, VringFile(index, false), fd)
}

// SetVringKick sends SET_VRING_KICK; fd < 0 sends NOFD.
func (c *Conn) SetVringKick(index uint32, fd int) error { return c.vringFile(SetVringKick, index, fd) }

// SetVringCall sends SET_VRING_CALL; fd < 0 sends NOFD.
func (c *Conn) SetVringCall(index uint32, fd int) error { return c.vringFile(SetVringCall, index, fd) }

// SetVringErr sends SET_VRING_ERR; fd < 0 sends NOFD.
func (c *Conn) SetVringErr(index uint32, fd int) error { return c.vringFile(SetVringErr, index, fd) }

// GetProtocolFeatures sends GET_PROTOCOL_FEATURES.
func (c *Conn) GetProtocolFeatures() (uint64, error) { return c.getU64(GetProtocolFeatures) }

// SetProtocolFeatures sends SET_PROTOCOL_FEATURES. From then on, if
// REPLY_ACK is in f, NEED_REPLY is set according to c.Ack.
func (c *Conn) SetProtocolFeatures(f uint64) error {
	if err := c.do(SetProtocolFeatures, U64(f)); err != nil {
		return err
	}
	c.mu.Lock()
	c.protocol = f
	c.mu.Unlock()
	return nil
}

// GetQueueNum sends GET_QUEUE_NUM.
func (c *Conn) GetQueueNum() (uint64, error) { return c.getU64(GetQueueNum) }

// SetVringEnable sends SET_VRING_ENABLE.
func (c *Conn) SetVringEnable(index uint32, enable bool) error {
	var v uint32
	if enable {
		v = 1
	}
	return c.do(SetVringEnable, VringState{index, v}.Bytes())
}

// SetBackendReqFd sends SET_BACKEND_REQ_FD with our socket end for the
// back end's requests.
func (c *Conn) SetBackendReqFd(fd int) error { return c.do(SetBackendReqFd, nil, fd) }

// GetConfig sends GET_CONFIG for size bytes at offset and returns the
// reply's payload bytes.
func (c *Conn) GetConfig(offset, size, flags uint32) ([]byte, error) {
	m, err := c.Call(GetConfig, ConfigMsg{offset, size, flags, make([]byte, size)}.Bytes(), nil)
	if err != nil {
		return nil, err
	}
	m.CloseFds()
	if len(m.Payload) < 12 {
		return nil, fmt.Errorf("vmm: GET_CONFIG reply payload is %d bytes", len(m.Payload))
	}
	return m.Payload[12:], nil
}

// SetConfig sends SET_CONFIG.
func (c *Conn) SetConfig(offset, flags uint32, data []byte) error {
	return c.do(SetConfig, ConfigMsg{offset, uint32(len(data)), flags, data}.Bytes())
}

// GetInflightFd sends GET_INFLIGHT_FD and returns the answer and its fd
// (owned by the caller).
func (c *Conn) GetInflightFd(numQueues, queueSize uint16) (Inflight, int, error) {
	m, err := c.Call(GetInflightFd, Inflight{NumQueues: numQueues, QueueSize: queueSize}.Bytes(), nil)
	if err != nil {
		return Inflight{}, -1, err
	}
	if len(m.Payload) != 20 || len(m.Fds) != 1 {
		m.CloseFds()
		return Inflight{}, -1, fmt.Errorf("vmm: GET_INFLIGHT_FD reply: %d bytes, %d fds", len(m.Payload), len(m.Fds))
	}
	p := m.Payload
	return Inflight{le.Uint64(p), le.Uint64(p[8:]), le.Uint16(p[16:]), le.Uint16(p[18:])}, m.Fds[0], nil
}

// SetInflightFd sends SET_INFLIGHT_FD.
func (c *Conn) SetInflightFd(f Inflight, fd int) error { return c.do(SetInflightFd, f.Bytes(), fd) }

// ResetDevice sends RESET_DEVICE.
func (c *Conn) ResetDevice() error { return c.do(ResetDevice, nil) }

// GetMaxMemSlots sends GET_MAX_MEM_SLOTS.
func (c *Conn) GetMaxMemSlots() (uint64, error) { return c.getU64(GetMaxMemSlots) }

// AddMemReg sends ADD_MEM_REG with the region's fd.
func (c *Conn) AddMemReg(r MemRegion, fd int) error { return c.do(AddMemReg, SingleRegionBytes(r), fd) }

// RemMemReg sends REM_MEM_REG; QEMU attaches the region's fd here too.
func (c *Conn) RemMemReg(r MemRegion, fd int) error {
	if fd < 0 {
		return c.do(RemMemReg, SingleRegionBytes(r))
	}
	return c.do(RemMemReg, SingleRegionBytes(r), fd)
}

// SetStatus sends SET_STATUS.
func (c *Conn) SetStatus(s uint8) error { return c.do(SetStatus, U64(uint64(s))) }

// GetStatus sends GET_STATUS.
func (c *Conn) GetStatus() (uint8, error) {
	v, err := c.getU64(GetStatus)
	return uint8(v), err
}
